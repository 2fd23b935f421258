"""Live progress of a running sweep, from the results Ray Tune already sends to the driver and
the phases workers announce before their first epoch (``pipeline.contract.phases``).

On a terminal: a table redrawn every few seconds at most (one line per running trial: its name,
its searched values, what it is doing or epoch e/E with its current CV mean; counts of
done/running/pending/pruned/NaN/failed; the best trial by the leaderboard's rule; elapsed time and,
once a trial has ended, an ETA). Elsewhere (CI logs, ``nohup``): plain lines, each phase of each
trial until the first trial ends, then a heartbeat at most every ``HEARTBEAT_S`` seconds (the
command prints a line per finished trial itself).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.tune import Callback

from pipeline.contract.phases import Phase, forget, phases
from pipeline.contract.results import EPOCH, EPOCHS_PLANNED, TrialStatus, ended_status, trial_label
from pipeline.inputs.spec import Objective
from pipeline.records.report import ranked, selected_epoch, selected_score, short_run_id
from pipeline.records.tracking import TrialRecord

REFRESH_S = 2.0
HEARTBEAT_S = 60.0


def eta_seconds(*, epochs_done: int, epochs_total: int, elapsed_s: float) -> float | None:
    """Time left at the rate epochs have been done so far (None before the first epoch)."""
    if epochs_done <= 0 or elapsed_s <= 0:
        return None
    return max(0, epochs_total - epochs_done) * elapsed_s / epochs_done


def clock(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def trial_name(trial_id: str, run_id: str | None) -> str:
    """``trial-00003 (b34e2e80)``: what the trial lines and the leaderboard call a trial."""
    return f"{trial_label(trial_id)} ({short_run_id(run_id)})" if run_id else trial_label(trial_id)


@dataclass
class TrialProgress:
    trial_id: str
    params: str
    epoch: int = 0
    epochs: int = 0
    score: float | None = None
    state: TrialStatus = TrialStatus.RUNNING
    phase: Phase | None = Phase.STARTING  # what it does before its first epoch ends (None after)
    phase_since: float = field(default_factory=time.monotonic)


@dataclass
class SweepProgress:
    """What the driver knows of a sweep's trials, as Ray Tune reports them and MLflow records them.

    ``trials_done_before``: trials a resumed sweep had ended before this run (not counted again)."""

    objective: Objective
    trials_planned: int
    epochs_per_trial: int
    trials_done_before: int = 0
    started: float = field(default_factory=time.monotonic)
    trials: dict[str, TrialProgress] = field(default_factory=dict)
    records: list[TrialRecord] = field(default_factory=list)  # the trials that ended, as recorded
    # The epochs done when the first trial ended, and when: the ETA's rate is measured after it,
    # past the start-up every sweep pays once (Ray, workers, TensorFlow, the first compiles).
    rate_start: tuple[float, int] | None = None

    def started_trial(self, trial_id: str, params: str) -> None:
        self.trials.setdefault(trial_id, TrialProgress(trial_id, params))

    def phase(self, trial_id: str, phase: Phase) -> bool:
        """A trial's worker announced ``phase``; True when that is news."""
        trial = self.trials.get(trial_id)
        if trial is None or trial.phase is None or trial.phase == phase:
            return False
        trial.phase, trial.phase_since = phase, time.monotonic()
        return True

    def result(self, trial_id: str, params: str, report: Mapping[str, Any]) -> None:
        trial = self.trials.setdefault(trial_id, TrialProgress(trial_id, params))
        trial.phase = None
        trial.epoch = int(report.get(EPOCH, trial.epoch))
        trial.epochs = int(report.get(EPOCHS_PLANNED, self.epochs_per_trial))
        score = report.get(self.objective.key)
        trial.score = float(score) if isinstance(score, (int, float)) and math.isfinite(score) else trial.score

    def ended(self, trial_id: str, params: str, state: TrialStatus) -> None:
        trial = self.trials.setdefault(trial_id, TrialProgress(trial_id, params))
        trial.state, trial.phase = state, None
        if self.rate_start is None:
            self.rate_start = (time.monotonic(), self.epochs_done())

    def recorded(self, record: TrialRecord) -> None:
        """A trial ended and is recorded: it may be the sweep's best."""
        self.records.append(record)

    def counts(self) -> dict[str, int]:
        states = [trial.state for trial in self.trials.values()]
        planned = self.trials_planned - self.trials_done_before
        return {
            "done": self.trials_done_before + sum(state is not TrialStatus.RUNNING for state in states),
            "running": states.count(TrialStatus.RUNNING),
            "pending": max(0, planned - len(states)),
            "pruned": states.count(TrialStatus.PRUNED),
            "nan": states.count(TrialStatus.NAN),
            "failed": states.count(TrialStatus.ERROR),
        }

    def best(self) -> TrialRecord | None:
        """The best ended trial by the leaderboard's rule: its score at its selected epoch."""
        ordered = ranked(self.records, self.objective)
        return ordered[0] if ordered else None

    def epochs_done(self) -> int:
        return sum(trial.epoch for trial in self.trials.values())

    def eta(self) -> float | None:
        """From the rate epochs have been done since the first trial ended (None before): ended
        trials count as whole (a pruned one took no more)."""
        if self.rate_start is None:
            return None
        since, epochs_then = self.rate_start
        total = sum(
            trial.epoch if trial.state is not TrialStatus.RUNNING else max(trial.epochs, trial.epoch)
            for trial in self.trials.values()
        )
        total += self.counts()["pending"] * self.epochs_per_trial
        done = self.epochs_done()
        rate = eta_seconds(
            epochs_done=done - epochs_then, epochs_total=total - epochs_then, elapsed_s=time.monotonic() - since
        )
        return 0.0 if done >= total else rate

    def summary_line(self) -> str:
        counts = self.counts()
        best = self.best()
        best_text = "no ranked trial yet" if counts["done"] else "no trial ended yet"
        if best is not None:
            best_text = (
                f"best {self.objective.key} {selected_score(best, self.objective.key):.4f} at epoch "
                f"{selected_epoch(best)} ({best.label} ({short_run_id(best.run_id)}))"
            )
        eta = self.eta()
        eta_text = "ETA once a trial has ended" if self.rate_start is None else f"ETA ~{clock(eta)}"
        return (
            f"{counts['done']}/{self.trials_planned} trials done, {counts['running']} running, "
            f"{counts['pending']} pending, {counts['pruned']} pruned, {counts['nan']} NaN, {counts['failed']} failed;"
            f" {best_text}; elapsed {clock(time.monotonic() - self.started)}, {eta_text}"
        )


class ProgressCallback(Callback):
    """Ray Tune events -> the sweep's progress on the terminal (or plain lines in a log).

    ``run_ids``: each trial's MLflow run id, as the recording callback creates them (the trials'
    names show it)."""

    def __init__(
        self, progress: SweepProgress, *, describe: Callable[[Mapping[str, Any]], str], console: Any, live: bool
    ):
        self.progress = progress
        self.describe: Callable[[Mapping[str, Any]], str] | None = describe  # None in a copy unpickled (__getstate__)
        self.console = console
        self.live = live
        self.run_ids: Mapping[str, str] = {}
        self._display: Any = None
        self._drawn = 0.0
        self._polled = 0.0
        self._heartbeat = time.monotonic()

    def __getstate__(self) -> dict[str, Any]:
        # Ray pickles callbacks with the experiment state; a terminal does not pickle.
        return {**self.__dict__, "console": None, "_display": None, "describe": None}

    def name(self, trial_id: str) -> str:
        return trial_name(trial_id, self.run_ids.get(trial_id))

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.progress.started_trial(trial.trial_id, self._params(trial))
        self._say(f"{self.name(trial.trial_id)}: {Phase.STARTING.value} ({self._params(trial)})")
        self._show()

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        """Every turn of Ray Tune's loop: the phases workers announced, at most every REFRESH_S."""
        if time.monotonic() - self._polled < REFRESH_S:
            return
        self._polled = time.monotonic()
        waiting = [trial_id for trial_id, trial in self.progress.trials.items() if trial.phase is not None]
        for trial_id, phase in phases(waiting).items():
            if self.progress.phase(trial_id, phase):
                self._say(f"{self.name(trial_id)}: {phase.value}")
        self._show(force=True)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        self.progress.result(trial.trial_id, self._params(trial), result)
        self._show()

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ended(trial, ended_status(trial.last_result or {}))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ended(trial, TrialStatus.ERROR)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self.close()

    def trial_recorded(self, record: TrialRecord) -> None:
        """A trial ended and its record is written (the sweep's ``on_trial_done``)."""
        self.progress.recorded(record)
        self._show(force=True)

    def close(self) -> None:
        if self._display is not None:
            self._display.stop()
            self._display = None

    def _ended(self, trial: Any, state: TrialStatus) -> None:
        self.progress.ended(trial.trial_id, self._params(trial), state)
        forget(trial.trial_id)
        self._show(force=True)

    def _params(self, trial: Any) -> str:
        return self.describe(trial.config) if self.describe else ""

    def _say(self, line: str) -> None:
        """A phase in a log, until the first trial has ended (then the trial lines say enough)."""
        if self.console is not None and not self.live and self.progress.rate_start is None:
            self.console.print(f"  {line}", highlight=False, soft_wrap=True)

    def _show(self, force: bool = False) -> None:
        if self.console is None:  # restored from a pickle: nowhere to show
            return
        now = time.monotonic()
        if not self.live:
            if now - self._heartbeat >= HEARTBEAT_S:
                self._heartbeat = now
                self.console.print(f"progress: {self.progress.summary_line()}", highlight=False)
            return
        if not force and now - self._drawn < REFRESH_S:
            return
        self._drawn = now
        if self._display is None:
            from rich.live import Live

            self._display = Live(self._table(), console=self.console, refresh_per_second=1, transient=True)
            self._display.start()
        else:
            self._display.update(self._table())

    def _table(self) -> Any:
        from rich.table import Table

        progress = self.progress
        table = Table(title=f"running trials ({progress.objective.key})", caption=progress.summary_line())
        for column in ("trial", "params", "epoch", progress.objective.key):
            table.add_column(column)
        now = time.monotonic()
        for trial in progress.trials.values():
            if trial.state is not TrialStatus.RUNNING:
                continue
            if trial.phase is not None:
                epoch, score = f"{trial.phase.value}, {now - trial.phase_since:.0f} s", "-"
            else:
                epoch = f"{trial.epoch}/{trial.epochs or progress.epochs_per_trial}"
                score = f"{trial.score:.4f}" if trial.score is not None else "-"
            table.add_row(self.name(trial.trial_id), trial.params, epoch, score)
        return table
