"""Early stopping end to end on a config that overfits: each trial stops `patience` epochs after
its best epoch, is scored and refit there, Optuna learns the score the leaderboard ranks, a rerun
stops at the same epoch, and a HyperModel.fit's EarlyStopping stops where the spec key does."""

from __future__ import annotations

import re

import pytest
import yaml
from helpers import MNIST1D_EXPERIMENT, foldsweep, history, latest_sweep, seed_store
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.records.tracking import Tag

pytestmark = pytest.mark.e2e

EPOCHS = 40
PATIENCE = 3


def overfitting(directory, name: str, **train) -> dict:
    """80 training samples, 2 folds, a wide CNN: the validation loss turns up within a few epochs."""
    return {
        "name": name,
        "experiment": f"{MNIST1D_EXPERIMENT}:build",
        "dataset": {"name": "mnist1d", "num_samples": 100},
        "cv": {"splitter": "stratified", "n_splits": 2, "seed": 0},
        "search": {
            "algorithm": "optuna",
            "num_samples": 3,
            "seed": 0,
            "space": {
                "learning_rate": {"choice": [0.01, 0.003, 0.001]},
                "batch_size": 8,
                "conv_layers": 2,
                "filters": 64,
                "kernel_size": 5,
                "dropout": 0.0,
            },
        },
        "train": {"epochs": EPOCHS, "metric": "loss", "seed": 0, "early_stopping": {"patience": PATIENCE}, **train},
        "resources": {"cpu": 1, "max_concurrent": 1},
        "tracking": {"uri": f"sqlite:///{directory / 'mlflow.db'}"},
    }


@pytest.fixture(scope="module")
def stopped_sweep(ray_cluster, tmp_path_factory):
    import pipeline.sweep

    directory = tmp_path_factory.mktemp("early")
    seed_store(directory / "mlflow.db")
    (directory / "spec.yaml").write_text(yaml.safe_dump(overfitting(directory, "early")))
    searchers = []
    make_searcher = pipeline.sweep.make_searcher

    def keep(spec, space):  # the Optuna searcher the sweep teaches, to read its study afterwards
        searchers.append(make_searcher(spec, space))
        return searchers[-1]

    pipeline.sweep.make_searcher = keep
    try:
        result = CliRunner().invoke(app, ["run", str(directory / "spec.yaml")], env={"COLUMNS": "250"})
    finally:
        pipeline.sweep.make_searcher = make_searcher
    assert result.exit_code == 0, result.output
    tracker, parent, trials = latest_sweep(f"sqlite:///{directory / 'mlflow.db'}", "early")
    return directory, result.output, tracker, parent, trials, searchers[0]


def test_each_trial_stops_patience_epochs_after_its_best_and_is_scored_there(stopped_sweep):
    directory, output, tracker, parent, trials, _ = stopped_sweep
    assert len(trials) == 3
    for trial in trials:
        metrics, curve = (
            trial.metrics,
            history(f"sqlite:///{directory / 'mlflow.db'}", trial.run_id, "mean_val_loss"),
        )
        stopped, best = int(metrics["stopped_epoch"]), int(metrics["best_epoch"])
        assert trial.state == "FINISHED" and trial.tags[Tag.STATUS] == "ok"
        assert stopped < EPOCHS / 2, "stopped well before the planned epochs"
        assert stopped - best == PATIENCE and max(curve) == stopped
        assert best == min(curve, key=lambda epoch: (curve[epoch], epoch))
        assert metrics["selected_mean_val_loss"] == curve[best]
    best_trial = next(trial for trial in trials if trial.run_id == parent.tags[Tag.BEST_RUN_ID])
    assert f"{best_trial.metrics['selected_mean_val_loss']:.4f}" in output  # the leaderboard's score
    assert parent.metrics["refit_epochs"] == best_trial.metrics["best_epoch"]


def test_optuna_learns_the_score_the_leaderboard_ranks(stopped_sweep):
    _, _, _, _, trials, searcher = stopped_sweep
    learned = sorted(trial.value for trial in searcher.proposing.study.trials if trial.value is not None)
    ranked_by = sorted(trial.metrics["selected_mean_val_loss"] for trial in trials)
    last_epochs = sorted(trial.metrics["mean_val_loss"] for trial in trials)
    assert learned == pytest.approx(ranked_by, rel=1e-9, abs=0)
    assert learned != pytest.approx(last_epochs, rel=1e-6, abs=0), "not the stopped epoch's score"


def test_a_rerun_reproduces_the_curve_and_stops_at_the_same_epoch(stopped_sweep):
    """A fresh process: the trial's thread pools are fixed once TensorFlow starts in a process."""
    directory, _, tracker, _, trials, _ = stopped_sweep
    original = trials[0]
    ran = foldsweep(
        "rerun", original.run_id[:8], "--tracking-uri", f"sqlite:///{directory / 'mlflow.db'}", cwd=directory
    )
    assert ran.exit_code == 0, ran.output
    stopped = int(original.metrics["stopped_epoch"])
    assert (
        f"stopped early after epoch {stopped}: train.early_stopping {{patience: {PATIENCE}, monitor: loss}}"
        in ran.output
    )
    again = tracker.reruns(original.run_id)[0]
    recorded, replayed = (
        history(f"sqlite:///{directory / 'mlflow.db'}", run.run_id, "mean_val_loss") for run in (original, again)
    )
    assert sorted(replayed) == list(range(1, stopped + 1))
    assert [replayed[epoch] for epoch in sorted(replayed)] == pytest.approx(
        [recorded[epoch] for epoch in sorted(recorded)], rel=1e-6, abs=0
    )


HYPERMODEL = f"""
import importlib.util

import keras
import keras_tuner

spec = importlib.util.spec_from_file_location("mnist1d_cnn", {str(MNIST1D_EXPERIMENT)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)


class Stopping(keras_tuner.HyperModel):
    def build(self, hp):
        return module.build(hp)

    def fit(self, hp, model, *args, **kwargs):
        kwargs["callbacks"] = kwargs.get("callbacks", []) + [keras.callbacks.EarlyStopping(monitor="val_loss", patience=2)]
        return model.fit(*args, **kwargs)
"""


def test_a_hypermodels_early_stopping_stops_where_the_spec_key_does(tmp_path, threads_kept):
    (tmp_path / "stopping.py").write_text(HYPERMODEL)
    stops = {}
    for name, spec in {
        "fit": overfitting(tmp_path, "fit", early_stopping=None)
        | {"experiment": f"{tmp_path / 'stopping.py'}:Stopping"},
        "spec": overfitting(tmp_path, "spec", early_stopping={"patience": 2, "monitor": "loss"}),
    }.items():
        spec["train"] = {key: value for key, value in spec["train"].items() if value is not None}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        result = CliRunner().invoke(app, ["trial", str(tmp_path / f"{name}.yaml"), "--set", "learning_rate=0.01"])
        assert result.exit_code == 0, result.output
        stops[name] = re.search(
            r"stopped early after epoch (\d+): train.early_stopping \{patience: 2, monitor: loss\}", result.output
        )
        assert stops[name], result.output
    assert stops["fit"].group(1) == stops["spec"].group(1)
    assert int(stops["fit"].group(1)) < EPOCHS
