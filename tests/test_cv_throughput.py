"""The benchmark's own options (pure logic; the benchmark itself is run by hand, not in tests)."""

import pytest

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
