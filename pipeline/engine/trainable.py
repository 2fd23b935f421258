"""One trial as a Ray Tune class trainable: ``FoldTrainable``, the Ray face of
``pipeline.engine.runner.TrialRunner``, and its checkpoints.

A class trainable (not a function) so that Ray Tune can keep a worker process across trials
(``reuse_actors``): ``reset_config`` drops the previous trial's models and Keras state and starts
the next trial in the same process.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ray import tune
from ray.tune.result import TRAINING_ITERATION

from pipeline.base.loaded import first_trial_started
from pipeline.base.tensorflow_private import registered_gradients
from pipeline.contract.phases import Phase, announce
from pipeline.contract.plan import plan_threads
from pipeline.contract.results import DONE, WORKER_MAPS, WORKER_RETIRES, WORKER_RSS, WORKER_TRIALS
from pipeline.engine.lifespan import Lifespan, release_trial
from pipeline.engine.runner import TrialRunner, TrialSettings, set_up_worker
from pipeline.inputs.folds import Fold

CHECKPOINT_FILE = "folds.npz"
LAST_REPORT_FILE = "last_report.json"


class FoldTrainable(tune.Trainable):
    """The Ray Tune face of ``TrialRunner``: each ``step`` is one epoch of every fold."""

    # Its name is recorded: Ray Tune names trial directories after it (FoldTrainable_<id>...) and
    # restores a sweep only with a trainable of the name it recorded (``--resume``).

    # tune.with_parameters passes data, folds and settings as keywords; Trainable.setup declares config alone
    def setup(  # type: ignore[override]
        self, config: Mapping[str, Any], *, data: Mapping[str, Any], folds: Sequence[Fold], settings: TrialSettings
    ) -> None:
        # A worker's first trial accounts for its start-up from when the process began loading
        # foldsweep (and TensorFlow with it) to unpickle this trainable, unless it loaded it ahead.
        started = first_trial_started(time.perf_counter())
        threads = plan_threads(settings.recipe.choices, cpus=settings.cpus, n_folds=len(folds))
        self._worker = set_up_worker(
            settings,
            x=data["x"],
            y=data["y"],
            one_hot=data.get("one_hot", False),
            threads=threads,
            on_phase=self._announce,
        )
        self._lifespan = Lifespan(settings.max_trials_per_worker, max_rss_mb=settings.worker_memory_mb())
        self._folds = folds
        self._settings = settings
        self._start(config, started=started)

    def _start(self, config: Mapping[str, Any], *, started: float | None = None) -> None:
        started = time.perf_counter() if started is None else started
        self._gradients_before = registered_gradients()
        self._lifespan.start_trial()
        self._announce(Phase.MODELS)
        self._runner: TrialRunner | None = TrialRunner(
            config, worker=self._worker, folds=self._folds, settings=self._settings, started=started
        )
        self._announce(Phase.FIRST_EPOCH)
        self._last_report: dict[str, Any] | None = None
        self._ended_report: dict[str, Any] | None = None

    @property
    def runner(self) -> TrialRunner:
        """The running trial's runner (none between trials, nor after ``cleanup``)."""
        if self._runner is None:
            raise RuntimeError(f"trial {self.trial_id} has no runner: it was reset or cleaned up")
        return self._runner

    def _announce(self, phase: Phase) -> None:
        announce(self.trial_id, phase)

    def step(self) -> dict[str, Any]:
        # A trial restored from the checkpoint of its last epoch (its driver was killed after
        # that epoch, before Ray Tune saved the trial as ended) ends with that epoch's report
        # again: Ray Tune asks a restored trial for a step without checking whether it is done,
        # and another epoch would train past the planned ones.
        report = self._ended_report or self.runner.step()
        self._last_report = report
        # Every epoch says whether this process retires after the trial: the last one before a
        # trial ends (finished, pruned or NaN) is the one Ray Tune acts on (pipeline.sweep).
        worker = self._lifespan.observe()  # one read of /proc/self/maps and status per epoch
        return {
            **report,
            WORKER_TRIALS: self._lifespan.trials,
            WORKER_MAPS: worker.maps,
            WORKER_RSS: worker.rss_mb,
            WORKER_RETIRES: self._lifespan.retire_reason(worker),
        }

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        import keras

        # Nothing of the previous trial (models, optimizers, traced graphs) may survive into
        # the next one: dropping the references and clearing Keras' global state does that.
        started = time.perf_counter()  # releasing the last trial is this one's start-up
        self._runner = None
        keras.backend.clear_session()
        release_trial(self._gradients_before)
        self._start(new_config, started=started)
        return True

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        import numpy as np

        np.savez(Path(checkpoint_dir) / CHECKPOINT_FILE, **self.runner.state())
        if self._last_report is not None:
            (Path(checkpoint_dir) / LAST_REPORT_FILE).write_text(json.dumps(self._last_report, default=_json_scalar))

    def restore(self, checkpoint_path: Any) -> None:
        super().restore(surviving_checkpoint(checkpoint_path))

    # Ray passes the directory save_checkpoint wrote (it returns None); Trainable declares a dict or None
    def load_checkpoint(self, checkpoint_dir: str) -> None:  # type: ignore[override]
        import numpy as np

        with np.load(Path(checkpoint_dir) / CHECKPOINT_FILE) as arrays:
            self.runner.load_state(arrays)
        # Checkpoints written before this file existed hold no report: such a trial trains on.
        saved_report = Path(checkpoint_dir) / LAST_REPORT_FILE
        last = json.loads(saved_report.read_text()) if saved_report.is_file() else None
        self._last_report = last
        self._ended_report = last if last is not None and last.get(DONE) else None

    def cleanup(self) -> None:
        self._runner = None


def surviving_checkpoint(saved: Any) -> Any:
    """What to restore a trial from: the checkpoint Ray Tune's experiment state names (``saved``,
    a result with ``checkpoint`` and ``metrics``), or, when that one is gone, the trial's newest.

    Ray Tune keeps one checkpoint per trial, each epoch's replacing the last, but writes its
    experiment state only every few seconds, so a driver killed in between leaves a state that
    names a checkpoint already deleted. The trial then goes on from the checkpoint that replaced
    it (one epoch further: its iteration is taken from the checkpoint itself) instead of failing.
    """
    import pyarrow.fs

    checkpoint = getattr(saved, "checkpoint", None)
    if checkpoint is None or _holds_state(checkpoint.filesystem, checkpoint.path):
        return saved
    fs = checkpoint.filesystem
    trial_dir = checkpoint.path.rstrip("/").rsplit("/", 1)[0]
    found = [
        info
        for info in fs.get_file_info(pyarrow.fs.FileSelector(trial_dir))
        if info.base_name.startswith("checkpoint_") and _holds_state(fs, info.path)
    ]
    if not found:
        return saved
    import numpy as np

    newest = type(checkpoint)(max(found, key=lambda info: info.base_name).path, filesystem=fs)
    with newest.as_directory() as directory, np.load(Path(directory) / CHECKPOINT_FILE) as arrays:
        epoch = int(arrays["epoch"])
    # Ray Tune deletes the named checkpoint when the trial's next one replaces it, and fails on
    # one that is not there: an empty directory stands in for it.
    fs.create_dir(checkpoint.path)
    replaced = copy.copy(saved)
    replaced.checkpoint = newest
    # One step is one epoch: Ray Tune's iteration count goes on from the checkpoint's epoch.
    replaced.metrics = {**saved.metrics, TRAINING_ITERATION: epoch}
    return replaced


def _json_scalar(value: Any) -> Any:
    """NumPy scalars in a report as the Python numbers they hold."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} in a trial's report cannot be kept in its checkpoint")


def _holds_state(fs: Any, path: str) -> bool:
    import pyarrow.fs

    return fs.get_file_info(f"{path.rstrip('/')}/{CHECKPOINT_FILE}").type == pyarrow.fs.FileType.File
