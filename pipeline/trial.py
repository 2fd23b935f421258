"""One trial = one config over all k folds, as a Ray Tune class trainable.

A class trainable (not a function) so that Ray Tune can keep a worker process across trials
(``reuse_actors``): ``reset_config`` drops the previous trial's models and Keras state and starts
the next trial in the same process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ray import tune

from pipeline.folds import Fold
from pipeline.plan import ExecutionChoices, ThreadPlan, plan_threads
from pipeline.results import EpochResult, TrialInfo
from pipeline.spec import SweepSpec

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
    cpus: float
    gpus: float
    choices: ExecutionChoices = ExecutionChoices()
    conditions: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: SweepSpec, *, experiment_path: Path, dataset_fingerprint: str,
                  conditions: Mapping[str, Any], eager: bool = False, check_numerics: bool = False) -> TrialSettings:
        train = spec.train
        # XLA-compiled steps are opaque to TensorFlow's numeric checking, and eager runs op by op.
        jit_compile = "off" if check_numerics or eager else train.jit_compile
        choices = ExecutionChoices(jit_compile=jit_compile, fused=train.fused, steps_per_launch=train.steps_per_launch,
                                   eager=eager, check_numerics=check_numerics)
        return cls(experiment_path=str(experiment_path), experiment_attr=spec.experiment_attr,
                   dataset_fingerprint=dataset_fingerprint, epochs=train.epochs, seed=train.seed,
                   from_logits=train.from_logits, cpus=spec.resources.cpu, gpus=spec.resources.gpu, choices=choices,
                   conditions=dict(conditions))


@dataclass(frozen=True)
class Worker:
    """A process set up to run trials: TensorFlow configured, data on the device, builder loaded."""

    data: Any
    build_fn: Callable[[Any], Any]
    device_notice: str


def set_up_worker(settings: TrialSettings, *, x: Any, y: Any, n_folds: int) -> Worker:
    """Configure TensorFlow for this process's trials (before anything starts it), copy the data
    to the device once, and load the experiment's builder."""
    from pipeline.resident import configure_devices

    notice = configure_devices(settings.gpus)
    configure_threads(plan_threads(settings.choices, cpus=settings.cpus, n_folds=n_folds))
    from pipeline.hypermodel import load_builder
    from pipeline.resident import resident_data

    return Worker(data=resident_data(settings.dataset_fingerprint, x, y),
                  build_fn=load_builder(Path(settings.experiment_path), settings.experiment_attr),
                  device_notice=notice)


class TrialRunner:
    """One trial, one config over its folds, one epoch per ``step``, without Ray.

    ``FoldTrainable`` runs it in a Ray worker; ``foldsweep trial`` and ``foldsweep rerun`` run
    it in their own process, so a debugging rerun executes exactly the sweep's trial code.
    """

    def __init__(self, config: Mapping[str, Any], *, worker: Worker, folds: Sequence[Fold], settings: TrialSettings,
                 fold_ids: Sequence[int] | None = None, epochs: int | None = None):
        from pipeline.space import resolve_config, split_config
        from pipeline.trainer import build_trainer
        from pipeline.training import TrainingParams

        self.config = resolve_config(config, settings.conditions)
        training, model_values = split_config(self.config)
        planned = training.pop("epochs")
        self.epochs = epochs or planned or settings.epochs
        self._worker = worker
        self._info_reported = False
        self.trainer = build_trainer(
            worker.build_fn, model_values, TrainingParams(**training), data=worker.data, folds=folds,
            seed=settings.seed, choices=settings.choices, fold_ids=fold_ids, from_logits=settings.from_logits,
            planned_epochs=self.epochs,
        )

    def next_epoch(self) -> EpochResult:
        return self.trainer.run_epoch().with_progress(epochs_planned=self.epochs)

    def step(self) -> dict[str, Any]:
        """One epoch as Ray Tune's flat result; the first in this process says where it ran."""
        result = self.next_epoch()
        info = None if self._info_reported else self.info()
        self._info_reported = True
        return result.report(info)

    def info(self) -> TrialInfo:
        import platform

        from pipeline.resident import transfers

        model = self.trainer.models[0]
        lines: list[str] = []
        model.summary(print_fn=lambda line, *args, **kwargs: lines.append(line))
        return TrialInfo(plan=self.trainer.plan, device_notice=self._worker.device_notice,
                         gpu_ids=",".join(_assigned_gpu_ids()), node_id=_node_id(), hostname=platform.node(),
                         data_transfers=transfers(), versions=_versions(), n_params=model.count_params(),
                         model_summary="\n".join(lines))


class FoldTrainable(tune.Trainable):
    """The Ray Tune face of ``TrialRunner``: each ``step`` is one epoch of every fold."""

    def setup(self, config: Mapping[str, Any], *, data: Mapping[str, Any], folds: Sequence[Fold],
              settings: TrialSettings) -> None:
        self._worker = set_up_worker(settings, x=data["x"], y=data["y"], n_folds=len(folds))
        self._folds = folds
        self._settings = settings
        self._start(config)

    def _start(self, config: Mapping[str, Any]) -> None:
        self._runner = TrialRunner(config, worker=self._worker, folds=self._folds, settings=self._settings)

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


def _versions() -> dict[str, str]:
    import platform

    import keras
    import ray
    import tensorflow as tf

    return {"tensorflow_version": tf.__version__, "keras_version": keras.__version__,
            "ray_version": ray.__version__, "python_version": platform.python_version()}


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def _assigned_gpu_ids() -> list[str]:
    import ray

    if not ray.is_initialized():
        return []
    return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


def configure_threads(threads: ThreadPlan) -> None:
    """Size TensorFlow's thread pools for this process's trials; must precede TensorFlow's
    initialisation."""
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads.intra_op)
        tf.config.threading.set_inter_op_parallelism_threads(threads.inter_op)
    except RuntimeError:
        pass  # TensorFlow already initialised in this process by an earlier trial
