"""A quick run of benchmarks.launch_form (its smallest settings: what its rows hold, not its numbers)."""

from __future__ import annotations

import json

import pytest

from benchmarks import launch_form

pytestmark = pytest.mark.e2e  # it runs the benchmark's own processes


def test_launch_form_times_both_forms_of_a_launch(tmp_path):
    out = tmp_path / "rows.json"
    assert launch_form.main(["--quick", "--cpus", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(row["dataset"], row["batch_size"], row["form"]) for row in rows] == [
        ("mnist1d", 64, "unrolled"),
        ("mnist1d", 64, "looped"),
    ]
    assert all(row["us_per_step"] > 0 and row["compile_s"] > 0 for row in rows)
    assert rows[0]["per_step_vs_unrolled"] == 1.0
    assert rows[1]["per_step_vs_unrolled"] == pytest.approx(rows[1]["us_per_step"] / rows[0]["us_per_step"])
