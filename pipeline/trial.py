"""One trial = one config over all k folds, as a Ray Tune class trainable.

A class trainable (not a function) so that Ray Tune can keep a worker process across trials
(``reuse_actors``): ``reset_config`` drops the previous trial's models and Keras state and starts
the next trial in the same process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ray import tune

from pipeline.folds import Fold

CHECKPOINT_FILE = "folds.npz"


@dataclass(frozen=True)
class TrialSettings:
    """What every trial of a sweep shares, besides the data and folds."""

    experiment_path: str
    experiment_attr: str
    dataset_fingerprint: str
    epochs: int
    seed: int
    from_logits: bool
    jit_compile: str
    cpus: float
    gpus: float
    conditions: Mapping[str, Any] = field(default_factory=dict)
    fused: str = "auto"
    steps_per_launch: int | str = "auto"


class TrialRunner:
    """One trial, one config over its folds, one epoch per ``step``, without Ray.

    ``FoldTrainable`` runs it in a Ray worker; ``foldsweep trial`` and ``foldsweep rerun`` run
    it in their own process, so a debugging rerun executes exactly the sweep's trial code.
    """

    def __init__(self, config: Mapping[str, Any], *, data: Any, folds: Sequence[Fold], settings: TrialSettings,
                 build_fn: Any, fold_ids: Sequence[int] | None = None, epochs: int | None = None,
                 eager: bool = False, jit_compile: str | None = None, device_notice: str = "",
                 check_numerics: bool = False):
        from pipeline.space import resolve_config, split_config
        from pipeline.trainer import FoldTrainer
        from pipeline.training import TrainingParams

        self.config = resolve_config(config, settings.conditions)
        training, model_values = split_config(self.config)
        planned = training.pop("epochs")
        self.epochs = epochs or planned or settings.epochs
        self._data = data
        self._device_notice = device_notice
        self.trainer = FoldTrainer(
            build_fn, model_values, TrainingParams(**training), data=data, folds=folds, seed=settings.seed,
            from_logits=settings.from_logits, jit_compile=jit_compile or settings.jit_compile, eager=eager,
            fold_ids=fold_ids, fused=settings.fused, steps_per_launch=settings.steps_per_launch,
            planned_epochs=self.epochs, check_numerics=check_numerics,
        )

    def step(self) -> dict[str, Any]:
        from pipeline.resident import transfers

        result = self.trainer.run_epoch()
        result["epochs_planned"] = self.epochs
        # A trial whose every fold went NaN has nothing left to train.
        all_failed = result["nan_failures"] == len(self.trainer.engines)
        result["done"] = self.trainer.epoch >= self.epochs or all_failed
        if self.trainer.epoch == 1:
            result.update(_system_info())
            model = self.trainer.models[0]
            result["n_params"] = model.count_params()
            lines: list[str] = []
            model.summary(print_fn=lambda line, *args, **kwargs: lines.append(line))
            result["model_summary"] = "\n".join(lines)
        # Where the trial ran, for the record: device, GPU slot, and how often this process has
        # copied the dataset to its device so far.
        result["device"] = self._data.device
        result["device_notice"] = self._device_notice
        result["gpu_ids"] = ",".join(str(i) for i in _assigned_gpu_ids())
        result["node_id"] = _node_id()
        result["jit_compile"] = self.trainer.jit_compile
        result["fused"] = self.trainer.fusion.enabled
        result["fused_reason"] = self.trainer.fusion.reason
        result["steps_per_launch"] = self.trainer.steps_per_launch
        result["data_transfers"] = transfers()
        return result


class FoldTrainable(tune.Trainable):
    """The Ray Tune face of ``TrialRunner``: each ``step`` is one epoch of every fold."""

    def setup(self, config: Mapping[str, Any], *, data: Mapping[str, Any], folds: Sequence[Fold],
              settings: TrialSettings) -> None:
        # Device memory settings must precede anything that initialises TensorFlow's devices.
        from pipeline.fused import side_by_side_loops
        from pipeline.resident import configure_devices

        self._device_notice = configure_devices(settings.gpus)
        configure_threads(settings.cpus, side_by_side_loops(settings.fused, n_folds=len(folds)))
        from pipeline.hypermodel import load_builder
        from pipeline.resident import resident_data

        self._data = resident_data(settings.dataset_fingerprint, data["x"], data["y"])
        self._folds = folds
        self._settings = settings
        self._build_fn = load_builder(Path(settings.experiment_path), settings.experiment_attr)
        self._start(config)

    def _start(self, config: Mapping[str, Any]) -> None:
        self._runner = TrialRunner(config, data=self._data, folds=self._folds, settings=self._settings,
                                   build_fn=self._build_fn, device_notice=self._device_notice)

    def step(self) -> dict[str, Any]:
        return self._runner.step()

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        import keras

        # Nothing of the previous trial (models, optimizers, traced graphs) may survive into
        # the next one: dropping the references and clearing Keras' global state does that.
        self._runner = None
        keras.backend.clear_session()
        self._start(new_config)
        return True

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        import numpy as np

        np.savez(Path(checkpoint_dir) / CHECKPOINT_FILE, **self._runner.trainer.state())

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        import numpy as np

        with np.load(Path(checkpoint_dir) / CHECKPOINT_FILE) as arrays:
            self._runner.trainer.load_state(arrays)

    def cleanup(self) -> None:
        self._runner = None


def _system_info() -> dict[str, str]:
    import platform

    import keras
    import ray
    import tensorflow as tf

    return {"tensorflow_version": tf.__version__, "keras_version": keras.__version__,
            "ray_version": ray.__version__, "python_version": platform.python_version(),
            "hostname": platform.node(), "tf_threads": configured_threads()}


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def _assigned_gpu_ids() -> list[str]:
    import ray

    if not ray.is_initialized():
        return []
    return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def thread_counts(cpus: float, fold_loops: int) -> tuple[int, int]:
    """TensorFlow's (intra-op, inter-op) threads for a trial of ``cpus`` CPUs that runs
    ``fold_loops`` fold loops side by side (its folds when fused, else 1)."""
    # Intra-op threads split big ops: one per CPU of the trial. Inter-op threads run the graph,
    # and an XLA launch holds one while it computes, so a fold loop trains fastest on a thread
    # of its own: an unfused trial at batch 8 ran 1.1-1.4x faster with 1 inter-op thread than
    # with 2 (work hopping between threads), and 3 fused folds ran 1.2x (MNIST-1D) to 2x
    # (protein) faster on 3 than on 2 (a fold waited for a thread while a core idled).
    # With one CPU the folds take turns on one thread rather than compute on several cores.
    compute = max(1, int(cpus))
    return compute, fold_loops if compute >= 2 else 1


def configure_threads(cpus: float, fold_loops: int) -> None:
    """Size TensorFlow's thread pools for this trial; must precede TensorFlow's initialisation."""
    import tensorflow as tf

    intra, inter = thread_counts(cpus, fold_loops)
    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)
    except RuntimeError:
        pass  # TensorFlow already initialised in this process by an earlier trial


def configured_threads() -> str:
    """The thread pools TensorFlow runs with, for the record."""
    import tensorflow as tf

    def count(value: int) -> str:
        return str(value) if value else "default"

    return (f"intra-op {count(tf.config.threading.get_intra_op_parallelism_threads())}, "
            f"inter-op {count(tf.config.threading.get_inter_op_parallelism_threads())}")
