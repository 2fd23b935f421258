"""A quick run of benchmarks.sweep_wallclock (--quick: what its result holds, not its numbers)."""

from __future__ import annotations

import json

import pytest

from benchmarks import sweep_wallclock

pytestmark = pytest.mark.e2e  # it runs the benchmark's own processes


def test_sweep_wallclock_times_a_sweep_against_the_naive_loop(tmp_path):
    out = tmp_path / "result.json"
    assert sweep_wallclock.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["configs"], result["folds"], result["epochs"]) == (1, 3, 1)
    assert result["naive_s"] > 0 and result["foldsweep_s"] > 0
    assert result["ratio"] == pytest.approx(result["naive_s"] / result["foldsweep_s"], rel=0.05)  # walls to 0.1 s
