"""A sweep's time account: its wall clock split into start, training, idle, refit and end."""

from __future__ import annotations

import pytest

from pipeline.contract.account import Span, sweep_account
from pipeline.contract.results import SWEEP_PARTS, recorded_sweep_account, sweep_fixed_s

STARTED = 1000.0


def account(*spans: tuple[float, float], ended: float, refit_s: float = 0.0):
    return sweep_account(
        started=STARTED,
        ended=STARTED + ended,
        refit_s=refit_s,
        parts=SWEEP_PARTS,
        trials=[Span(STARTED + start, STARTED + end) for start, end in spans],
    )


def test_two_slots_overlap_into_one_training_span_and_the_rest_is_start_idle_refit_and_end():
    # slot 1: 8-20, then 21-30; slot 2: 9-15, then nothing until a trial at 33-40; refit 40-45.
    sweep = account((8, 20), (9, 15), (21, 30), (33, 40), ended=47.0, refit_s=5.0)
    assert sweep.as_dict() == pytest.approx(
        {
            "sweep_startup_s": 8.0,
            "sweep_training_s": 12 + 9 + 7,
            "sweep_idle_s": 1 + 3,
            "sweep_refit_s": 5.0,
            "sweep_finish_s": 2.0,
            "other_s": 0.0,
        }
    )
    assert sweep.wall_s == 47.0 and sweep_fixed_s(sweep) == pytest.approx(8 + 4 + 2)


def test_trials_of_an_earlier_command_count_only_from_this_ones_start():
    """A resumed sweep's trials that ended before this command count for nothing; one that was
    running counts from the command's start."""
    sweep = account((-50, -20), (-5, 10), ended=12.0)
    assert sweep.as_dict()["sweep_startup_s"] == 0.0 and sweep.as_dict()["sweep_training_s"] == 10.0
    assert sweep.other_s == pytest.approx(0.0)


def test_without_a_trial_that_trained_it_is_all_fixed_cost_but_the_refit():
    sweep = account(ended=6.0, refit_s=1.0)
    assert sweep.as_dict()["sweep_training_s"] == 0.0 and sweep_fixed_s(sweep) == pytest.approx(5.0)


def test_read_back_from_a_parent_runs_metrics_and_none_from_an_older_sweep():
    sweep = account((8, 20), ended=25.0)
    metrics = {"sweep_wall_s": sweep.wall_s, **dict(sweep.parts), "sweep_fixed_s": sweep_fixed_s(sweep)}
    assert recorded_sweep_account(metrics) == sweep
    assert recorded_sweep_account({"trials_ok": 4.0}) is None
