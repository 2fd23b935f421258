"""The benchmark's own options (pure logic), and a quick run of it (its smallest settings: what its
rows hold, not its numbers)."""

import json

import pytest

from benchmarks import cv_throughput
from benchmarks.cv_throughput import hp_values, model_under_test


def test_hp_values_are_read_as_a_spec_reads_them():
    assert hp_values(["dropout=0.0", "batch_norm=true", "filters=32", "learning_rate=1e-3"]) == {
        "dropout": 0.0,
        "batch_norm": True,
        "filters": 32,
        "learning_rate": 0.001,
    }


def test_an_hp_without_a_value_is_refused_naming_it():
    with pytest.raises(SystemExit, match="--hp: expected NAME=VALUE, got 'dropout'"):
        hp_values(["dropout"])


def test_hp_values_go_over_the_hypermodels_defaults():
    _, values = model_under_test("protein_cnn_bn", dataset=None, dropout=False, hp={"dropout": 0.0})
    assert values == {"batch_norm": True, "dropout": 0.0}


@pytest.mark.e2e  # it runs the benchmark's own processes
def test_cv_throughput_measures_a_variant_against_the_machines_peak(tmp_path):
    out = tmp_path / "rows.json"
    arguments = ["--quick", "--datasets", "mnist1d", "--batch-sizes", "64", "--variants", "fused", "--repeats", "1"]
    assert cv_throughput.main([*arguments, "--cpus", "1", "--json", str(out)]) == 0
    peak, fused = json.loads(out.read_text())
    assert (peak["variant"], fused["variant"], fused["batch_size"]) == (cv_throughput.PEAK, "fused", 64)
    assert peak["gflops_per_s"] > 0 and fused["samples_per_s"] > 0 and fused["compile_s"] > 0
