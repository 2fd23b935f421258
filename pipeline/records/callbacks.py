"""The Ray Tune callbacks of the driver: the one that records a sweep's trials in MLflow (a
child run per trial, its epochs as they come, its end: status, selected epoch, history), and the
one that loads the plots' matplotlib beside the last trials."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ray.tune import Callback

from pipeline.contract.results import EpochSelection, TrialStatus, ended_status, trial_label
from pipeline.records.plots import load_matplotlib
from pipeline.records.provenance import DataInput
from pipeline.records.tracking import Tag, Tracker, TrialRecord, TrialRecorder


def trial_run_name(trial_id: str, values: Mapping[str, Any], searched: Sequence[str]) -> str:
    """``trial-00003 learning_rate=0.003 batch_size=8 filters=32``: the trial's number in its sweep
    and every value the sweep searches (the spec's and the hypermodel's), so that a list of runs
    (the MLflow UI's) says which is which."""
    return " ".join([trial_label(trial_id), *searched_values(values, searched)])


def searched_values(values: Mapping[str, Any], searched: Sequence[str]) -> list[str]:
    """``name=value`` of each searched hyperparameter a trial uses (an inactive one has none)."""
    return [
        f"{name}={values[name]:.4g}" if isinstance(values[name], float) else f"{name}={values[name]}"
        for name in searched
        if name in values
    ]


class MlflowTrialCallback(Callback):
    """Ray Tune events -> MLflow child runs, written from the driver."""

    def __init__(
        self,
        uri: str,
        *,
        parent_run_id: str,
        sweep_name: str,
        selection: EpochSelection,
        on_recorded: Callable[[TrialRecord], None] | None = None,
        conditions: Mapping[str, Any] | None = None,
        searched: Sequence[str] = (),
        run_tags: Mapping[str, str] | None = None,
        data: Sequence[DataInput] = (),
    ):
        self.uri = uri
        self.run_tags = dict(run_tags or {})  # every trial run's: where it came from
        self.data = tuple(data)  # the sweep's data splits, as dataset inputs
        self.searched = tuple(searched)  # what the sweep searches: named in each trial's run name
        self.parent_run_id = parent_run_id
        self.sweep_name = sweep_name
        self.selection = selection
        self.on_recorded = on_recorded
        self.conditions = dict(conditions or {})
        self._run_ids: dict[str, str] = {}
        self.run_ids: dict[str, str] = {}  # every trial's run id, ended ones too (the progress view names them)
        self._recorded_epochs: dict[str, frozenset[int]] = {}
        self._retries: dict[str, int] = {}
        self._tracker: Tracker | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Ray pickles callbacks with the experiment state; a live client does not pickle.
        state = dict(self.__dict__)
        state["_tracker"] = None
        state["on_recorded"] = None
        return state

    @property
    def tracker(self) -> Tracker:
        if self._tracker is None:
            self._tracker = Tracker(self.uri)
        return self._tracker

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._recorder(trial)

    def _recorder(self, trial: Any) -> TrialRecorder:
        """The trial's recorder; its run is created here if Ray reports the trial before it ever
        started (a trial whose worker fails while being set up gets an error but no start event)."""
        from pipeline.inputs.space import resolve_config

        if trial.trial_id not in self._run_ids:
            # The values the trial uses: no threshold without clipping, no inactive conditional hp.
            values = resolve_config(trial.config, self.conditions)
            recorder = self.tracker.trial_recorder(
                parent_run_id=self.parent_run_id,
                role="trial",
                config=values,
                tags={**self.run_tags, Tag.SWEEP: self.sweep_name},
                run_name=trial_run_name(trial.trial_id, values, getattr(self, "searched", ())),
                trial_id=trial.trial_id,
                data=self.data,
            )
            self._run_ids[trial.trial_id] = self.run_ids[trial.trial_id] = recorder.run_id
            self._recorded_epochs[trial.trial_id] = recorder.recorded_epochs
        return TrialRecorder(
            self.tracker,
            self._run_ids[trial.trial_id],
            self.selection,
            recorded_epochs=self._recorded_epochs.get(trial.trial_id, frozenset()),
        )

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        if trial.trial_id in self._run_ids:
            self._recorder(trial).log_epoch(result)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._finish(trial, status=ended_status(trial.last_result or {}))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._finish(trial, status=TrialStatus.ERROR, error=_error_text(trial))

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        """A worker died and Ray Tune retries the trial (resources.max_failures): count it."""
        self._retries[trial.trial_id] = self._retries.get(trial.trial_id, 0) + 1
        recorder = self._recorder(trial)
        recorder.count_retry(self._retries[trial.trial_id])
        # The retry goes on from the trial's last checkpoint, which may be older than its last
        # recorded epoch.
        self._recorded_epochs[trial.trial_id] = recorder.epochs_in_record()

    def _finish(self, trial: Any, *, status: TrialStatus, error: str | None = None) -> None:
        recorder = self._recorder(trial)
        del self._run_ids[trial.trial_id]
        recorder.finish(status, error=error, last_report=trial.last_result)
        if self.on_recorded is not None:
            self.on_recorded(self.tracker.trial_record(recorder.run_id))


def _error_text(trial: Any) -> str:
    error_file = getattr(trial, "error_file", None)
    if error_file and Path(error_file).is_file():
        return Path(error_file).read_text(errors="replace").strip()
    return str(getattr(trial, "error_msg", "") or "unknown error")


def slot_free(trials: Sequence[Any], *, n_trials: int, slots: int) -> bool:
    """The sweep's tail: no trial is left to start (``n_trials`` make the sweep), and fewer run
    than the ``slots``, so a core the trials no longer use is free."""
    statuses = [trial.status for trial in trials]
    return (
        len(trials) >= n_trials
        and not any(status in ("PENDING", "PAUSED") for status in statuses)
        and statuses.count("RUNNING") < slots
    )


class PlottingLoadedEarly(Callback):
    """Ray Tune callback: matplotlib, which the sweep's plots need once every trial has ended,
    loaded in a thread of the driver as soon as a slot is free in the tail (``slot_free``), on
    the core the last trials leave idle, instead of after them."""

    def __init__(self, *, slots: int, n_trials: int):
        self._slots = slots
        self._n_trials = n_trials
        self._loading: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Ray pickles callbacks with the experiment state; a thread does not pickle, and a
        # restored sweep has one of its own.
        return {}

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        if not getattr(self, "_slots", None) or self._loading is not None:  # unpickled, or started
            return
        if slot_free(trials, n_trials=self._n_trials, slots=self._slots):
            self._loading = threading.Thread(target=load_matplotlib, name="matplotlib-import", daemon=True)
            self._loading.start()
