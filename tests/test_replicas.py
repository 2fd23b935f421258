"""A quick run of benchmarks.replicas (its smallest settings: what its rows hold, not its numbers)."""

from __future__ import annotations

import json

import pytest

from benchmarks import replicas

pytestmark = pytest.mark.e2e  # it runs the benchmark's own processes


def test_replicas_measures_a_trial_of_repeated_folds(tmp_path):
    out = tmp_path / "rows.json"
    arguments = ["--batch-sizes", "64", "--layouts", "fused", "--replicas", "6", "--repeats", "1", "--epochs", "1"]
    assert replicas.main([*arguments, "--cpus", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(row["replicas"], row["vs_first"]) for row in rows] == [(6, 1.0)]  # 2 repeats of 3 folds
    assert all(row["samples_per_s"] > 0 and row["plan"] for row in rows)
