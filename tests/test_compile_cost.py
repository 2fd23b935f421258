"""A quick run of benchmarks.compile_cost (its smallest settings: what its rows hold, not its numbers)."""

from __future__ import annotations

import json

import pytest

from benchmarks import compile_cost

pytestmark = pytest.mark.e2e  # it runs the benchmark's own processes


def test_compile_cost_runs_a_trial_and_reads_its_compile_and_epoch_seconds(tmp_path):
    out = tmp_path / "rows.json"
    assert compile_cost.main(["--blocks", "1", "--batches", "16", "--variants", "noxla-1cpu", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["blocks"], row["variant"], row["batch_size"]) == (1, "noxla-1cpu", 16)
    assert "intra-op 1" in row["plan"]
    assert row["compile_s"] > 0 and row["epoch_s"] > 0 and row["plan"]
