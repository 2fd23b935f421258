"""One trial = one config over all k folds, one epoch per step, without Ray: ``TrialRunner``,
with what every trial of a sweep shares (``TrialSettings``) and what a process sets up once for
its trials (``set_up_worker``).

``pipeline.engine.trainable`` runs it as Ray Tune's trainable; ``foldsweep trial`` and
``foldsweep rerun`` run it in their own process, so a debugging rerun executes exactly the
sweep's trial code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pipeline.contract.phases import Phase
from pipeline.contract.plan import ThreadPlan, TrialPlan
from pipeline.contract.results import RUNNING_BEST_PREFIX, EpochResult, TrialInfo
from pipeline.engine.recipe import TrainingRecipe
from pipeline.engine.runtime import configure_devices, configure_threads, host_memory_per_trial_mb
from pipeline.engine.stopping import Patience
from pipeline.inputs.folds import Fold
from pipeline.inputs.spec import Objective, SweepSpec, TrainSpec


@dataclass(frozen=True)
class TrialSettings:
    """What every trial of a sweep shares, besides the data and folds: where its experiment is,
    its resources, its objective, and its training recipe (the spec's ``train`` section)."""

    experiment_path: str
    experiment_attr: str
    dataset_fingerprint: str
    recipe: TrainingRecipe
    cpus: float = 1.0
    gpus: float = 0.0
    objective: Objective = Objective()
    max_trials_per_worker: int | Literal["auto"] = "auto"
    max_worker_memory: int | str = "auto"  # MiB
    max_concurrent: int | None = None

    @classmethod
    def from_spec(
        cls,
        spec: SweepSpec,
        *,
        experiment_path: Path,
        dataset_fingerprint: str,
        conditions: Mapping[str, Any],
        fit_arguments: Mapping[str, str] | None = None,
        eager: bool = False,
        check_numerics: bool = False,
    ) -> TrialSettings:
        recipe = TrainingRecipe.from_spec(
            spec, conditions=conditions, fit_arguments=fit_arguments, eager=eager, check_numerics=check_numerics
        )
        return cls(
            experiment_path=str(experiment_path),
            experiment_attr=spec.experiment_attr,
            dataset_fingerprint=dataset_fingerprint,
            recipe=recipe,
            cpus=spec.resources.cpu,
            gpus=spec.resources.gpu,
            objective=spec.objective,
            max_trials_per_worker=spec.resources.max_trials_per_worker,
            max_worker_memory=spec.resources.max_worker_memory,
            max_concurrent=spec.resources.max_concurrent,
        )

    def worker_memory_mb(self) -> float | None:
        """The memory a worker may hold (``resources.max_worker_memory``; auto: a trial's share of
        the host's memory), None where the host does not tell its size."""
        if self.max_worker_memory != "auto":
            return float(self.max_worker_memory)
        share = host_memory_per_trial_mb(cpus=self.cpus, max_concurrent=self.max_concurrent)
        return None if share is None else float(share[0])

    @property
    def train(self) -> TrainSpec:
        return self.recipe.train


@dataclass(frozen=True)
class Worker:
    """A process set up to run trials: TensorFlow configured, data on the device, builder loaded."""

    data: Any
    build_fn: Callable[[Any], Any]
    device_notice: str


def configure_tensorflow(*, gpus: float, threads: ThreadPlan, compile_cache: bool = True) -> str:
    """TensorFlow's process-wide settings for trials of ``gpus`` GPUs each (device memory, thread
    pools, the persistent compile cache), before anything starts it in this process; returns the
    device notice.

    Raises:
        ThreadsError: TensorFlow already runs here with other thread pools.
    """
    cache_notice = use_compile_cache(gpus=gpus, wanted=compile_cache)
    notice = configure_devices(gpus)
    configure_threads(threads)
    return "; ".join(part for part in (notice, cache_notice) if part)


def use_compile_cache(*, gpus: float, wanted: bool) -> str:
    """The persistent compile cache on for this process's device (TensorFlow reads its XLA flags
    once, when it sets up its devices), or off when not ``wanted`` or when the GPU cannot be
    identified; returns the notice of that ("" when on or not wanted)."""
    from pipeline.base.accelerator import UnknownGpu
    from pipeline.base.compile_cache import activate, deactivate, device_kind

    if not wanted:
        deactivate()
        return ""
    try:
        activate(device_kind=device_kind(gpus))
    except UnknownGpu as exc:
        deactivate()
        return f"compile cache off: the GPU cannot be identified ({exc})"
    return ""


def set_up_worker(
    settings: TrialSettings,
    *,
    x: Any,
    y: Any,
    one_hot: bool = False,
    threads: ThreadPlan,
    on_phase: Callable[[Phase], None] = lambda phase: None,
) -> Worker:
    """Configure TensorFlow for this process's trials (before anything starts it), copy the data
    to the device once, and load the experiment's builder; ``on_phase`` hears each step begin."""
    on_phase(Phase.TENSORFLOW)
    notice = configure_tensorflow(gpus=settings.gpus, threads=threads, compile_cache=settings.train.compile_cache)
    from pipeline.engine.resident import resident_data
    from pipeline.inputs.hypermodel import load_builder

    on_phase(Phase.DATA)

    return Worker(
        data=resident_data(settings.dataset_fingerprint, x, y, one_hot=one_hot),
        build_fn=load_builder(Path(settings.experiment_path), settings.experiment_attr),
        device_notice=notice,
    )


class TrialRunner:
    """One trial, one config over its folds, one epoch per ``step``, without Ray.

    ``FoldTrainable`` runs it in a Ray worker; ``foldsweep trial`` and ``foldsweep rerun`` run
    it in their own process, so a debugging rerun executes exactly the sweep's trial code.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        worker: Worker,
        folds: Sequence[Fold],
        settings: TrialSettings,
        fold_ids: Sequence[int] | None = None,
        epochs: int | None = None,
        replay: TrialPlan | None = None,
        started: float | None = None,
    ):
        """``started``: when the trial began in this process (``time.perf_counter``; its worker's
        set-up for a process's first trial), where its time account starts; else now."""
        from pipeline.engine.trainer import build_trainer

        self.started = time.perf_counter() if started is None else started
        recipe = settings.recipe
        resolved = recipe.resolve(config)
        self.config = resolved.config
        self.epochs = epochs or resolved.epochs
        self._worker = worker
        self._info_reported = False
        self._objective = settings.objective
        early_stopping = settings.train.early_stopping
        self.patience = Patience(early_stopping) if early_stopping is not None else None
        self.running_best = math.nan
        self.trainer = build_trainer(
            worker.build_fn,
            resolved,
            recipe,
            data=worker.data,
            folds=folds,
            fold_ids=fold_ids,
            planned_epochs=self.epochs,
            replay=replay,
        )

    def next_epoch(self) -> EpochResult:
        """One more epoch of every fold; the last one when the planned epochs are reached, every
        fold went NaN, or the trial's own early stopping says so."""
        result = self.trainer.run_epoch().with_progress(epochs_planned=self.epochs)
        score = result.cv_summary().get(self._objective.key, math.nan)
        if math.isfinite(score) and (math.isnan(self.running_best) or self._objective.better(score, self.running_best)):
            self.running_best = score
        if (
            self.patience is not None
            and not result.done
            and self.patience.observe(result.epoch, result.live_scores(self.patience.rule.monitor))
        ):
            result = result.stopped_early()
        return result

    def step(self) -> dict[str, Any]:
        """One epoch as Ray Tune's flat result, with the trial's time account until now; the first
        in this process says where it ran."""
        result = self.next_epoch()
        result = replace(result, account=self.trainer.time_account(started=self.started, now=time.perf_counter()))
        info = None if self._info_reported else self.info()
        self._info_reported = True
        return {**result.report(info), f"{RUNNING_BEST_PREFIX}{self._objective.key}": self.running_best}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the fold models' state, and the trial's own running best and
        patience (so that a resumed trial stops where it would have)."""
        import numpy as np

        arrays = self.trainer.state()
        arrays["running_best"] = np.array(self.running_best)
        if self.patience is not None:
            arrays["patience"] = np.array(self.patience.state(), dtype=np.float64)
        return arrays

    def load_state(self, arrays: Mapping[str, Any]) -> None:
        self.trainer.load_state(arrays)
        if "running_best" in arrays:
            self.running_best = float(arrays["running_best"])
        if self.patience is not None and "patience" in arrays:
            self.patience.restore(arrays["patience"])

    def info(self) -> TrialInfo:
        import platform

        from pipeline.engine.resident import transfers

        model = self.trainer.models[0]
        lines: list[str] = []
        model.summary(print_fn=lambda line, *args, **kwargs: lines.append(line))
        optimizer = self.trainer.optimizer
        return TrialInfo(
            plan=self.trainer.plan,
            device_notice=self._worker.device_notice,
            compile_source=optimizer.source,
            loss=self.trainer.loss.name,
            params_in_effect={"optimizer": optimizer.name, "learning_rate": optimizer.learning_rate},
            gpu_ids=",".join(_assigned_gpu_ids()),
            node_id=_node_id(),
            hostname=platform.node(),
            data_transfers=transfers(),
            versions=_versions(),
            n_params=model.count_params(),
            model_summary="\n".join(lines),
        )


def _versions() -> dict[str, str]:
    import platform

    import keras
    import ray
    import tensorflow as tf

    return {
        "tensorflow_version": tf.__version__,
        "keras_version": keras.__version__,
        "ray_version": ray.__version__,
        "python_version": platform.python_version(),
    }


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def _assigned_gpu_ids() -> list[str]:
    import ray

    if not ray.is_initialized():
        return []
    return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
