"""A quick run of benchmarks.replicas (its smallest settings: what its rows hold, not its numbers)."""

from __future__ import annotations

import json

import pytest

from benchmarks import replicas

pytestmark = pytest.mark.e2e  # it runs the benchmark's own processes


def test_replicas_compares_more_replicas_with_the_first_count(tmp_path):
    out = tmp_path / "rows.json"
    arguments = ["--batch-sizes", "64", "--layouts", "fused", "--replicas", "3,6", "--repeats", "1", "--epochs", "1"]
    assert replicas.main([*arguments, "--cpus", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [row["replicas"] for row in rows] == [3, 6]
    assert rows[0]["vs_first"] == 1.0  # one round: the ratio of the two rates
    assert rows[1]["vs_first"] == pytest.approx(rows[1]["samples_per_s"] / rows[0]["samples_per_s"], abs=1e-3)
    assert all(row["samples_per_s"] > 0 and row["plan"] for row in rows)
