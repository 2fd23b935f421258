"""benchmarks.compile_cost: a quick run (its smallest settings: what its rows hold, not its
numbers), and the fit of stacked folds' saving it prints from its rows."""

from __future__ import annotations

import json

import pytest

from benchmarks import compile_cost
from pipeline.contract.compile_cost import CompileCosts


@pytest.mark.e2e  # it runs the benchmark's own processes
def test_compile_cost_runs_a_trial_and_reads_its_compile_and_epoch_seconds(tmp_path):
    out = tmp_path / "rows.json"
    assert compile_cost.main(["--blocks", "1", "--batches", "16", "--variants", "noxla-1cpu", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["blocks"], row["variant"], row["batch_size"]) == (1, "noxla-1cpu", 16)
    assert "intra-op 1" in row["plan"]
    assert row["compile_s"] > 0 and row["epoch_s"] > 0 and row["plan"]


def test_stacked_saving_fit_prices_each_pairs_saving_at_the_plans_compile_estimate():
    base, per_sample = 0.4e-3, 0.01e-3

    def pair(layers, batch_size, *, slower):
        """A stacked and a graph row whose saving, in the plan's compile seconds, lies on the line,
        on a machine whose compiles take ``slower`` times the plan's estimate."""
        costs = CompileCosts(layers, batch_size)
        steps = compile_cost.FOLDS * (compile_cost.FOLD_TRAIN_SAMPLES // batch_size)
        saved = (base - per_sample * batch_size) * slower * steps
        graph_compile = slower * costs.compile_s("graph")
        return [
            {
                "layers": layers,
                "batch_size": batch_size,
                "variant": "noxla-1cpu",
                "epoch_s": 1.0 + saved,
                "compile_s": graph_compile,
            },
            {
                "layers": layers,
                "batch_size": batch_size,
                "variant": "stacked",
                "epoch_s": 1.0,
                "compile_s": slower * costs.compile_s("stacked"),
            },
        ]

    rows = [*pair(7, 4, slower=1.0), *pair(19, 8, slower=1.5), *pair(67, 16, slower=0.8)]
    fitted = compile_cost.stacked_saving_fit(rows)
    assert fitted is not None
    assert fitted == pytest.approx((base, per_sample), rel=1e-9)
    # A row without its pair, and a pair whose stacked form compiled no longer, are left out.
    unpriced = pair(19, 32, slower=1.0)
    unpriced[1]["compile_s"] = unpriced[0]["compile_s"]
    assert compile_cost.stacked_saving_fit([*rows, *unpriced, rows[0] | {"layers": 3}]) == fitted
    # One batch size alone draws no line.
    assert compile_cost.stacked_saving_fit(pair(7, 8, slower=1.0) + pair(19, 8, slower=1.0)) is None
