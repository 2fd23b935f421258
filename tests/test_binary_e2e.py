"""A binary classifier end to end: a KerasTuner hypermodel ending in one sigmoid unit, compiled
with binary_crossentropy and a compiled AUC, swept stacked on real Ray and MLflow, scored by binary
accuracy and ranked by its AUC, refit on the test split, ranked in cv_results.csv, its divergence
recorded as NaN, and rerun."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from helpers import assert_rerun_reproduces, binary_data, run_learning_rate_grid, seed_store

from pipeline.records.tracking import Tag

pytestmark = pytest.mark.e2e

EPOCHS = 3
HYPERMODEL = """
import keras
import keras_tuner


class BindingSite(keras_tuner.HyperModel):
    def build(self, hp):
        inputs = keras.Input(shape=(16, 1))
        x = keras.layers.Conv1D(hp.Int("filters", 4, 16, step=4, default=8), 3, activation="relu")(inputs)
        x = keras.layers.Flatten()(x)
        outputs = keras.layers.Dense(1, activation="sigmoid")(x)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy", keras.metrics.AUC(name="auc")])
        return model
"""


@pytest.fixture(scope="module")
def binary_sweep(ray_cluster, tmp_path_factory):
    directory = tmp_path_factory.mktemp("binary")
    x, y = binary_data(600)
    x_test, y_test = binary_data(200, seed=1)
    np.savez(directory / "sites.npz", x=x, y=y, x_test=x_test, y_test=y_test)
    (directory / "sites.py").write_text(HYPERMODEL)
    store = f"sqlite:///{seed_store(directory / 'mlflow.db')}"
    output, tracker, parent, by_rate = run_learning_rate_grid(
        directory,
        store,
        {
            "name": "sites",
            "experiment": "sites.py:BindingSite",
            "dataset": "sites.npz",
            "cv": {"splitter": "stratified", "n_splits": 3, "seed": 0},
            # Batch 8 on one CPU: the folds are stacked into one XLA program; a rate of 1e6 diverges.
            "search": {
                "algorithm": "grid",
                "space": {"optimizer": "sgd", "learning_rate": {"grid": [0.01, 1.0e6]}, "batch_size": 8, "filters": 8},
            },
            "train": {"epochs": EPOCHS, "seed": 0, "metric": "auc"},
            "resources": {"cpu": 1, "max_concurrent": 1},
        },
    )
    return directory, store, output, tracker, parent, by_rate


def test_a_sigmoid_head_trains_stacked_and_is_scored_by_binary_accuracy(binary_sweep):
    _, _, _, _, _, by_rate = binary_sweep
    learned = by_rate[0.01]
    assert learned.tags[Tag.STATUS] == "ok"
    assert "stacked" in learned.tags[Tag.of("fused_reason")]
    # Chance is 0.5; an arg max over one unit would score every sample as class 0 (about 0.5).
    for k in range(3):
        assert 0.8 < learned.metrics[f"split{k}_val_accuracy"] <= 1.0
        assert 0.0 < learned.metrics[f"split{k}_val_loss"] < 0.6931  # below a constant 0.5's log 2
    assert learned.tags[Tag.of("loss")] == "binary_crossentropy"


def test_a_diverging_binary_head_is_recorded_as_nan(binary_sweep):
    _, _, _, _, _, by_rate = binary_sweep
    diverged = by_rate[1.0e6]
    assert diverged.tags[Tag.STATUS] == "nan"
    assert diverged.tags[Tag.of("nan_epoch")] == "1"


def test_the_binary_sweep_is_ranked_refit_and_tabled(binary_sweep):
    directory, _, output, tracker, parent, by_rate = binary_sweep
    learned = by_rate[0.01]
    assert parent.tags[Tag.BEST_RUN_ID] == learned.run_id
    assert 0.8 < parent.metrics["test_accuracy"] <= 1.0
    rows = list(csv.DictReader(open(tracker.artifact_file(parent.run_id, "cv_results.csv", directory))))
    ok = next(row for row in rows if row["status"] == "ok")
    assert (
        ok["rank_val_accuracy"] == "1"
        and next(row for row in rows if row["status"] == "nan")["rank_val_accuracy"] == ""
    )
    assert float(ok["mean_val_accuracy"]) == pytest.approx(
        np.mean([learned.metrics[f"selected_split{k}_val_accuracy"] for k in range(3)])
    )
    # Ranked by the compiled AUC (max): its columns, rank, and the refit's test_auc, which is what
    # the saved refit model scores on the test split.
    assert ok["rank_val_auc"] == "1" and 0.8 < float(ok["mean_val_auc"]) <= 1.0 and ok["std_val_auc"] != ""
    assert float(ok["mean_val_auc"]) == pytest.approx(
        np.mean([learned.metrics[f"selected_split{k}_val_auc"] for k in range(3)])
    )
    assert parent.params["train.mode"] == "max"
    assert f"{float(ok['mean_val_auc']):.4f}" in output  # the leaderboard ranks on it
    import keras

    model = keras.models.load_model(tracker.artifact_file(parent.run_id, "refit_model.keras", directory))
    data = np.load(directory / "sites.npz")
    auc = keras.metrics.AUC()
    auc.update_state(data["y_test"], model.predict(data["x_test"], verbose=0))
    assert parent.metrics["test_auc"] == pytest.approx(float(auc.result()), abs=1e-4)


def test_a_rerun_of_a_binary_trial_reproduces_its_per_fold_losses(binary_sweep):
    """A fresh process: the trial's thread pools are fixed once TensorFlow starts in a process."""
    directory, store, _, _, _, by_rate = binary_sweep
    keys = [f"split{k}_{name}" for k in range(3) for name in ("train_loss", "val_loss", "val_accuracy", "val_auc")]
    assert_rerun_reproduces(store, directory, by_rate[0.01], keys, epochs=EPOCHS)
