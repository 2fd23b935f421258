"""Live progress of a sweep: the arithmetic, the best by the leaderboard's rule, the phases of a
trial before its first epoch (its plain lines in a log: tests/test_newcomer_e2e.py)."""

from __future__ import annotations

import re

import pytest

from pipeline.contract.phases import Phase
from pipeline.contract.results import TrialStatus
from pipeline.inputs.spec import Objective
from pipeline.records.progress import SweepProgress, clock, eta_seconds
from pipeline.records.report import Standings, selected_score
from pipeline.records.tracking import TrialRecord


def record(trial: str, status: TrialStatus, *, selected: float, last: float, epoch: int = 1) -> TrialRecord:
    """A recorded trial scored ``selected`` at its selected ``epoch``, ``last`` at its last."""
    metrics = {"mean_val_loss": last, "selected_mean_val_loss": selected, "best_epoch": float(epoch)}
    return TrialRecord(
        run_id=f"{trial}{'0' * 31}",
        run_name=f"trial-{trial}",
        trial_id=f"x_{trial}",
        state="FINISHED",
        status=status,
        params={},
        metrics=metrics,
    )


def test_eta_is_the_epochs_left_at_the_rate_so_far():
    assert eta_seconds(epochs_done=10, epochs_total=40, elapsed_s=50.0) == pytest.approx(150.0)
    assert eta_seconds(epochs_done=40, epochs_total=40, elapsed_s=200.0) == 0
    assert eta_seconds(epochs_done=0, epochs_total=40, elapsed_s=5.0) is None
    assert clock(150) == "2:30" and clock(3725) == "1:02:05" and clock(None) == "-"


def test_progress_counts_trials_and_shows_no_eta_before_a_trial_ends():
    progress = SweepProgress(Objective("loss", "min"), trials_planned=5, epochs_per_trial=4)
    progress.started_trial("a", "lr=0.1")
    assert "0/5 trials done, 1 running, 4 pending" in progress.summary_line()
    assert "no trial ended yet" in progress.summary_line() and "ETA once a trial has ended" in progress.summary_line()
    progress.result("a", "lr=0.1", {"epoch": 2, "epochs_planned": 4, "mean_val_loss": 0.5})
    progress.result("b", "lr=0.01", {"epoch": 4, "epochs_planned": 4, "mean_val_loss": 0.3})
    progress.ended("b", "lr=0.01", TrialStatus.OK)
    progress.result("c", "lr=9", {"epoch": 1, "epochs_planned": 4, "mean_val_loss": 0.1})
    progress.ended("c", "lr=9", TrialStatus.NAN)
    assert progress.counts() == {"done": 2, "running": 1, "pending": 2, "pruned": 0, "nan": 1, "failed": 0}
    # The rate is measured from the first trial's end (6 epochs done then, past the start-up):
    # c's epoch and a's third came in 1 s; of 17 epochs in all (a's 4, b's 4, c's 1, 2 pending
    # trials of 4), 9 are to go.
    since, epochs_then = progress.rate_start
    assert epochs_then == 6
    progress.rate_start = (since - 1.0, epochs_then)
    progress.result("a", "lr=0.1", {"epoch": 3, "epochs_planned": 4, "mean_val_loss": 0.4})
    assert progress.eta() == pytest.approx(9 / 2, rel=1e-2)
    assert re.search(r"no ranked trial yet; elapsed 0:0\d, ETA ~0:0[45]$", progress.summary_line())


def test_a_resumed_sweep_counts_the_trials_it_ended_before():
    progress = SweepProgress(Objective("loss", "min"), trials_planned=4, epochs_per_trial=2, trials_done_before=2)
    progress.started_trial("c", "")
    assert progress.counts() == {"done": 2, "running": 1, "pending": 1, "pruned": 0, "nan": 0, "failed": 0}


def test_the_live_best_is_the_leaderboards_best_after_every_ended_trial():
    """Its score at its selected epoch, never its last epoch's, and never a NaN or pruned trial's."""
    objective = Objective("loss", "min")
    ended = [
        record("00000", TrialStatus.OK, selected=0.30, last=0.45, epoch=3),
        record("00001", TrialStatus.OK, selected=0.35, last=0.36, epoch=8),  # better last epoch, worse selected
        record("00002", TrialStatus.NAN, selected=1e6, last=1e6),
        record("00003", TrialStatus.PRUNED, selected=0.10, last=0.10),
        record("00004", TrialStatus.OK, selected=0.20, last=0.50, epoch=2),
    ]
    progress = SweepProgress(objective, trials_planned=5, epochs_per_trial=8)
    for count, trial in enumerate(ended, start=1):
        progress.recorded(trial)
        board = Standings.of(ended[:count], objective, n_splits=2)
        assert progress.best() is board.ranked[0]
        expected = f"best mean_val_loss {selected_score(board.ranked[0], objective.key):.4f} at epoch"
        assert expected in progress.summary_line()
    assert "best mean_val_loss 0.2000 at epoch 2 (trial-00004 (00004000))" in progress.summary_line()


def test_a_trials_phase_shows_until_its_first_epoch_ends():
    progress = SweepProgress(Objective("loss", "min"), trials_planned=1, epochs_per_trial=2)
    progress.started_trial("a", "")
    assert progress.trials["a"].phase is Phase.STARTING
    assert progress.phase("a", Phase.TENSORFLOW) and not progress.phase("a", Phase.TENSORFLOW)
    assert progress.phase("a", Phase.FIRST_EPOCH)
    progress.result("a", "", {"epoch": 1, "epochs_planned": 2, "mean_val_loss": 0.5})
    assert progress.trials["a"].phase is None and not progress.phase("a", Phase.MODELS)  # late news is no news
