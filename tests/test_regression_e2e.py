"""A regression end to end: float targets, a CNN compiled with MSE and a compiled MAE, swept on real
Ray and MLflow and ranked by the MAE (lower is better): leaderboard order, cv_results.csv columns
(no accuracy), the best run, the refit's test_mae against what the saved refit model scores, and a
rerun reproducing the recorded MAE histories."""

from __future__ import annotations

import csv
import warnings

import numpy as np
import pytest
from helpers import assert_rerun_reproduces, binary_data, run_learning_rate_grid, seed_store

from pipeline.records.tracking import Tag

pytestmark = pytest.mark.e2e

EPOCHS = 2
MODEL = """
import keras


def build(hp):
    model = keras.Sequential([keras.layers.Conv1D(4, 3, activation="relu"), keras.layers.Flatten(),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model
"""


def regression_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    x, _ = binary_data(n, seed=seed)
    return x, (x[:, 4:8, 0].mean(axis=1) + 0.05 * np.random.default_rng(seed).normal(size=n)).astype(np.float32)


@pytest.fixture(scope="module")
def regression_sweep(ray_cluster, tmp_path_factory):
    directory = tmp_path_factory.mktemp("regression")
    x, y = regression_data(240, 0)
    x_test, y_test = regression_data(80, 1)
    np.savez(directory / "bumps.npz", x=x, y=y, x_test=x_test, y_test=y_test)
    (directory / "bumps.py").write_text(MODEL)
    store = f"sqlite:///{seed_store(directory / 'mlflow.db')}"
    output, tracker, parent, by_rate = run_learning_rate_grid(
        directory,
        store,
        {
            "name": "bumps",
            "experiment": "bumps.py",
            "dataset": "bumps.npz",
            "cv": {"splitter": "kfold", "n_splits": 3, "seed": 0},
            "search": {"algorithm": "grid", "space": {"learning_rate": {"grid": [0.01, 0.0001]}, "batch_size": 16}},
            "train": {"epochs": EPOCHS, "seed": 0, "metric": "mae"},
            "resources": {"cpu": 1, "max_concurrent": 1},
        },
    )
    return directory, store, output, tracker, parent, by_rate


def test_a_regression_sweep_is_ranked_by_its_compiled_mae_lower_first(regression_sweep):
    directory, _, output, tracker, parent, by_rate = regression_sweep
    fast, slow = by_rate[0.01], by_rate[0.0001]
    assert parent.params["train.mode"] == "min"
    assert fast.metrics["selected_mean_val_mae"] < slow.metrics["selected_mean_val_mae"]
    assert parent.tags[Tag.BEST_RUN_ID] == fast.run_id
    assert "split0_val_accuracy" not in fast.metrics and "split0_val_mae" in fast.metrics
    rows = list(csv.DictReader(open(tracker.artifact_file(parent.run_id, "cv_results.csv", directory))))
    ranks = {row["run_id"]: row["rank_val_mae"] for row in rows}
    assert ranks == {fast.run_id: "1", slow.run_id: "2"}
    assert "mean_val_accuracy" not in rows[0] and {"mean_val_loss", "std_val_mae", "split2_val_mae"} <= set(rows[0])
    # the leaderboard: best (lowest MAE) first
    assert output.index(f"{fast.metrics['selected_mean_val_mae']:.4f}") < output.index(
        f"{slow.metrics['selected_mean_val_mae']:.4f}"
    )


def test_the_refits_test_mae_is_what_the_saved_model_scores(regression_sweep):
    import keras
    from mlflow import MlflowClient

    directory, _, _, tracker, parent, by_rate = regression_sweep
    with warnings.catch_warnings():
        # Keras warns where the saved optimizer's state does not fit the model's.
        warnings.filterwarnings("error", message="Skipping variable loading")
        model = keras.models.load_model(tracker.artifact_file(parent.run_id, "refit_model.keras", directory))
    data = np.load(directory / "bumps.npz")
    # Saved as fit leaves a model: its optimizer has taken every step of the refit.
    best = next(run for run in by_rate.values() if run.run_id == parent.tags[Tag.BEST_RUN_ID])
    assert int(model.optimizer.iterations.numpy()) == int(best.metrics["best_epoch"]) * -(-len(data["x"]) // 16)
    mae = float(np.mean(np.abs(model.predict(data["x_test"], verbose=0)[:, 0] - data["y_test"])))
    assert parent.metrics["test_mae"] == pytest.approx(mae, rel=1e-4)
    assert "test_accuracy" not in parent.metrics
    # Logged as the sweep's model, and registered nowhere: the spec does not ask for it.
    assert parent.tags[Tag.REFIT_MODEL].startswith("models:/") and Tag.REGISTERED_MODEL not in parent.tags
    assert MlflowClient(tracker.uri).search_registered_models() == []  # MLflow's own registry, as its UI lists it


def test_a_rerun_reproduces_the_recorded_mae_histories(regression_sweep):
    directory, store, _, _, _, by_rate = regression_sweep
    assert_rerun_reproduces(store, directory, by_rate[0.01], [f"split{k}_val_mae" for k in range(3)], epochs=EPOCHS)
