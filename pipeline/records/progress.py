"""Live progress of a running sweep, from the results Ray Tune already sends to the driver.

On a terminal: a table redrawn every few seconds at most (one line per running trial with its
key params, epoch e/E and current CV mean; counts of done/running/pending/pruned/NaN/failed; the
best CV mean so far and its trial; elapsed time and an ETA). Elsewhere (CI logs, ``nohup``):
plain lines, a heartbeat at most every ``HEARTBEAT_S`` seconds (the command prints a line per
finished trial itself).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ray.tune import Callback

from pipeline.contract.results import EPOCH, EPOCHS_PLANNED, TrialStatus, ended_status, trial_label
from pipeline.inputs.spec import Objective

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


@dataclass
class TrialProgress:
    trial_id: str
    params: str
    epoch: int = 0
    epochs: int = 0
    score: float | None = None
    state: TrialStatus = TrialStatus.RUNNING


@dataclass
class SweepProgress:
    """What the driver knows of a sweep's trials, as Ray Tune reports them."""

    objective: Objective
    trials_planned: int
    epochs_per_trial: int
    started: float = field(default_factory=time.monotonic)
    trials: dict[str, TrialProgress] = field(default_factory=dict)

    def result(self, trial_id: str, params: str, report: Mapping[str, Any]) -> None:
        trial = self.trials.setdefault(trial_id, TrialProgress(trial_id, params))
        trial.epoch = int(report.get(EPOCH, trial.epoch))
        trial.epochs = int(report.get(EPOCHS_PLANNED, self.epochs_per_trial))
        score = report.get(self.objective.key)
        trial.score = float(score) if isinstance(score, (int, float)) and math.isfinite(score) else trial.score

    def ended(self, trial_id: str, params: str, state: TrialStatus) -> None:
        self.trials.setdefault(trial_id, TrialProgress(trial_id, params)).state = state

    def counts(self) -> dict[str, int]:
        states = [trial.state for trial in self.trials.values()]
        return {"done": sum(state is not TrialStatus.RUNNING for state in states),
                "running": states.count(TrialStatus.RUNNING), "pending": max(0, self.trials_planned - len(states)),
                "pruned": states.count(TrialStatus.PRUNED), "nan": states.count(TrialStatus.NAN),
                "failed": states.count(TrialStatus.ERROR)}

    def best(self) -> TrialProgress | None:
        scored = [trial for trial in self.trials.values() if trial.score is not None and trial.state in (TrialStatus.RUNNING, TrialStatus.OK)]
        return min(scored, key=lambda trial: self.objective.sort_key(trial.score), default=None)

    def eta(self) -> float | None:
        """From the epochs done so far: ended trials count as whole (a pruned one took no more)."""
        done = sum(trial.epoch for trial in self.trials.values())
        total = sum(trial.epoch if trial.state is not TrialStatus.RUNNING else max(trial.epochs, trial.epoch)
                    for trial in self.trials.values())
        total += self.counts()["pending"] * self.epochs_per_trial
        return eta_seconds(epochs_done=done, epochs_total=total, elapsed_s=time.monotonic() - self.started)

    def summary_line(self) -> str:
        counts = self.counts()
        best = self.best()
        # The trial's label, as the per-trial lines and the leaderboard show it (not Ray's id).
        best_text = f"best {self.objective.key} {best.score:.4f} ({trial_label(best.trial_id)})" if best else \
            "no score yet"
        return (f"{counts['done']}/{self.trials_planned} trials done, {counts['running']} running, "
                f"{counts['pending']} pending, {counts['pruned']} pruned, {counts['nan']} NaN, {counts['failed']} failed;"
                f" {best_text}; elapsed {clock(time.monotonic() - self.started)}, ETA {clock(self.eta())}")


class ProgressCallback(Callback):
    """Ray Tune events -> the sweep's progress on the terminal (or heartbeat lines)."""

    def __init__(self, progress: SweepProgress, *, describe: Callable[[Mapping[str, Any]], str],
                 console: Any, live: bool):
        self.progress = progress
        self.describe = describe
        self.console = console
        self.live = live
        self._display: Any = None
        self._drawn = 0.0
        self._heartbeat = time.monotonic()

    def __getstate__(self) -> dict[str, Any]:
        # Ray pickles callbacks with the experiment state; a terminal does not pickle.
        return {**self.__dict__, "console": None, "_display": None, "describe": None}

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        self.progress.result(trial.trial_id, self._params(trial), result)
        self._show()

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.progress.ended(trial.trial_id, self._params(trial), ended_status(trial.last_result or {}))
        self._show(force=True)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.progress.ended(trial.trial_id, self._params(trial), TrialStatus.ERROR)
        self._show(force=True)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._display is not None:
            self._display.stop()
            self._display = None

    def _params(self, trial: Any) -> str:
        return self.describe(trial.config) if self.describe else ""

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
        for trial in progress.trials.values():
            if trial.state is TrialStatus.RUNNING:
                score = f"{trial.score:.4f}" if trial.score is not None else "-"
                table.add_row(trial.trial_id, trial.params, f"{trial.epoch}/{trial.epochs or progress.epochs_per_trial}",
                              score)
        return table
