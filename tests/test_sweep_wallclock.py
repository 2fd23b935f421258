"""benchmarks.sweep_wallclock's two sides at its --quick size, in this process: the spec it gives
`foldsweep run` validates, and the naive loop trains and scores its config. (Its `foldsweep run`
is a process of a sweep's whole cost, which `make test` leaves to the command's own tests.)"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from benchmarks import sweep_wallclock
from pipeline.cli import app

pytestmark = pytest.mark.training


def test_the_sweep_it_times_is_a_valid_spec_of_its_grid(tmp_path):
    path = sweep_wallclock.write_spec(1, sweep_wallclock.QUICK_GRID, tmp_path)
    validated = CliRunner().invoke(app, ["validate", str(path)])
    assert validated.exit_code == 0, validated.output
    assert validated.output.startswith(f"ok {path}")


def test_the_naive_loop_scores_each_config_by_its_mean_fold_accuracy():
    seconds, scores = sweep_wallclock.naive_loop(1, sweep_wallclock.QUICK_GRID)
    assert seconds > 0 and len(scores) == len(sweep_wallclock.configs(sweep_wallclock.QUICK_GRID)) == 1
    assert 0.1 < scores[0] <= 1.0  # better than chance over 10 classes after an epoch
