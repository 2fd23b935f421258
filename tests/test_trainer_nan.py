"""NaN handling in the engine: where a fold went NaN, the fold frozen, the others unaffected."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import MNIST1D_EXPERIMENT
from run_machinery import between_trials

from pipeline.contract.plan import ExecutionChoices
from pipeline.contract.results import EVAL_STEP, NAN_FOLD_SCORES, NanEvent, cv_summary
from pipeline.engine.recipe import TrainingRecipe
from pipeline.engine.resident import resident_data
from pipeline.engine.trainer import build_trainer
from pipeline.inputs.datasets import load_dataset
from pipeline.inputs.folds import make_folds
from pipeline.inputs.hypermodel import load_builder
from pipeline.inputs.spec import CVSpec, DatasetSpec

pytestmark = pytest.mark.training  # every test trains until, or past, a NaN

MODEL = {"conv_layers": 1, "filters": 16, "kernel_size": 3, "dropout": 0.0}


@pytest.fixture(scope="module")
def data_and_folds():
    data = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 400}))
    return data, make_folds(CVSpec(splitter="stratified", n_splits=3, seed=0), data).folds


def trainer(data_and_folds, jit_compile="auto", **params):
    data, folds = data_and_folds
    settings = {"batch_size": 8, "learning_rate": 1e-3, "optimizer": "adam", **params}
    between_trials()
    return build_trainer(
        load_builder(MNIST1D_EXPERIMENT, "build"),
        {**MODEL, **settings},
        TrainingRecipe(choices=ExecutionChoices(jit_compile=jit_compile)),
        data=resident_data(data.fingerprint, data.x, data.y),
        folds=folds,
    )


def test_a_nan_fold_stays_nan_in_its_split_and_counts_as_worst_in_the_mean():
    summary = cv_summary([{"val_accuracy": 0.9, "val_loss": 0.3}, {"val_accuracy": math.nan, "val_loss": math.nan}])
    assert math.isnan(summary["split1_val_accuracy"]) and math.isnan(summary["split1_val_loss"])
    assert summary["mean_val_accuracy"] == pytest.approx((0.9 + NAN_FOLD_SCORES["val_accuracy"]) / 2)
    assert summary["mean_val_loss"] == pytest.approx((0.3 + NAN_FOLD_SCORES["val_loss"]) / 2)
    assert all(math.isfinite(summary[key]) for key in summary if key.startswith(("mean_", "std_")))


@pytest.mark.parametrize("jit", ["on", "off"])
def test_divergence_is_located_and_the_fold_frozen(data_and_folds, jit):
    diverging = trainer(data_and_folds, jit_compile=jit, optimizer="sgd", learning_rate=50.0)
    assert diverging.plan.jit_compile == (jit == "on")
    first = diverging.run_epoch().report()
    assert first["nan_failures"] >= 1
    assert first["nan_epoch"] == 1 and first["nan_step"] >= 0
    assert math.isfinite(first["nan_last_finite_loss"]) and math.isfinite(first["nan_grad_norm"])
    assert math.isfinite(first["mean_val_accuracy"]) and math.isfinite(first["mean_val_loss"])
    fold = first["nan_fold"]
    frozen = [np.asarray(v).copy() for v in diverging.engines[fold].model.trainable_variables]
    # The bad update was never applied: the frozen fold keeps finite weights, and trains no more.
    assert all(np.isfinite(v).all() for v in frozen)
    second = diverging.run_epoch().report()
    assert (second["nan_fold"], second["nan_epoch"], second["nan_step"]) == (fold, 1, first["nan_step"])
    for before, after in zip(frozen, diverging.engines[fold].model.trainable_variables):
        np.testing.assert_array_equal(before, np.asarray(after))


def test_clipping_keeps_the_same_config_finite(data_and_folds):
    clipped = trainer(data_and_folds, optimizer="sgd", learning_rate=50.0, clipping="global_norm", clip_threshold=0.1)
    assert clipped.run_epoch().report()["nan_failures"] == 0


def test_the_other_folds_train_on_exactly_as_without_the_nan_fold(data_and_folds):
    reference = trainer(data_and_folds)
    with_failure = trainer(data_and_folds)
    with_failure.engines[1].failure = NanEvent(epoch=1, step=EVAL_STEP, last_finite_loss=math.nan, grad_norm=math.nan)
    for _ in range(2):
        expected, got = reference.run_epoch().report(), with_failure.run_epoch().report()
        assert math.isnan(got["split1_val_loss"])
        for k in (0, 2):
            assert got[f"split{k}_val_loss"] == pytest.approx(expected[f"split{k}_val_loss"], rel=1e-6)
    assert got["nan_failures"] == 1 and got["nan_fold"] == 1
