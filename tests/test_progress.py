"""Live progress of a sweep: the arithmetic (its plain lines in a log: tests/test_newcomer_e2e.py)."""

from __future__ import annotations

import pytest

from pipeline.records.progress import SweepProgress, clock, eta_seconds
from pipeline.inputs.spec import Objective


def test_eta_is_the_epochs_left_at_the_rate_so_far():
    assert eta_seconds(epochs_done=10, epochs_total=40, elapsed_s=50.0) == pytest.approx(150.0)
    assert eta_seconds(epochs_done=40, epochs_total=40, elapsed_s=200.0) == 0
    assert eta_seconds(epochs_done=0, epochs_total=40, elapsed_s=5.0) is None
    assert clock(150) == "2:30" and clock(3725) == "1:02:05" and clock(None) == "-"


def test_progress_counts_trials_and_finds_the_best():
    progress = SweepProgress(Objective("loss", "min"), trials_planned=5, epochs_per_trial=4)
    progress.result("a", "lr=0.1", {"epoch": 2, "epochs_planned": 4, "mean_val_loss": 0.5})
    progress.result("b", "lr=0.01", {"epoch": 4, "epochs_planned": 4, "mean_val_loss": 0.3})
    progress.ended("b", "lr=0.01", "ok")
    progress.result("c", "lr=9", {"epoch": 1, "epochs_planned": 4, "mean_val_loss": 0.1})
    progress.ended("c", "lr=9", "nan")
    assert progress.counts() == {"done": 2, "running": 1, "pending": 2, "pruned": 0, "nan": 1, "failed": 0}
    assert progress.best().trial_id == "b"  # a NaN trial's score is no best
    # 7 epochs done; to go: a's 2, and 2 pending trials of 4 epochs (c ended after 1).
    done, total = 2 + 4 + 1, 4 + 4 + 1 + 2 * 4
    expected = eta_seconds(epochs_done=done, epochs_total=total, elapsed_s=1.0)
    progress.started -= 1.0 - 1e-9
    assert progress.eta() == pytest.approx(expected, rel=1e-3)
    line = progress.summary_line()
    assert "2/5 trials done, 1 running, 2 pending, 0 pruned, 1 NaN, 0 failed" in line and "(trial-b)" in line
