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


def test_stacked_saving_fit_prices_the_savings_at_the_plans_compile_estimate():
    per_layer, per_multiply_add = 0.02e-3, 0.03e-9

    def pair(layers, filters, batch_size, *, slower):
        """A stacked and a graph row whose saving, in the plan's compile seconds, lies on the plane,
        on a machine whose compiles and steps take ``slower`` times the plan's."""
        costs = CompileCosts(layers, batch_size)
        steps = compile_cost.FOLDS * (compile_cost.FOLD_TRAIN_SAMPLES // batch_size)
        adds = 1000 * filters * layers
        saved = (per_layer * layers - per_multiply_add * adds * batch_size) * slower * steps
        row = {"layers": layers, "filters": filters, "batch_size": batch_size, "multiply_adds": adds}
        return [
            row | {"variant": "noxla-1cpu", "epoch_s": 1.0 + saved, "compile_s": slower * costs.compile_s("graph")},
            row | {"variant": "stacked", "epoch_s": 1.0, "compile_s": slower * costs.compile_s("stacked")},
        ]

    def rows(slower):
        return [*pair(7, 64, 16, slower=slower), *pair(19, 32, 4, slower=slower), *pair(67, 32, 8, slower=slower)]

    fitted = compile_cost.stacked_saving_fit(rows(1.0))
    assert fitted is not None
    assert fitted == pytest.approx((per_layer, per_multiply_add), rel=1e-6)
    # On a machine twice as slow, compiles and steps alike, the fit in the plan's seconds is the same.
    assert compile_cost.stacked_saving_fit(rows(2.0)) == pytest.approx(fitted, rel=1e-6)
    # A row without its pair, and a pair whose stacked form compiled no longer, are left out.
    unpriced = pair(19, 32, 32, slower=1.0)
    unpriced[1]["compile_s"] = unpriced[0]["compile_s"]
    assert compile_cost.stacked_saving_fit([*rows(1.0), *unpriced, rows(1.0)[0] | {"layers": 3}]) == pytest.approx(
        fitted, rel=1e-6
    )
    # Where the graph is the slower per multiply-add, the layers' term alone is fitted.
    slower_graph = [*pair(7, 32, 8, slower=1.0), *pair(19, 64, 16, slower=1.0)]
    slower_graph[2]["epoch_s"] += 0.5  # the pair of the most multiply-adds saves the more
    alone = compile_cost.stacked_saving_fit(slower_graph)
    assert alone is not None and alone[1] == 0.0 and alone[0] > per_layer
    # Pairs whose layers and batch multiply-adds grow in proportion cannot tell the two apart.
    assert compile_cost.stacked_saving_fit(pair(7, 32, 8, slower=1.0) + pair(14, 32, 8, slower=1.0)) is None
