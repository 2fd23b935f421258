"""End to end: `foldsweep run` with real Ray, real TensorFlow and a real MLflow store in tmp_path."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import Replace, recorded_sweeps
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.inputs.datasets import load_dataset
from pipeline.inputs.folds import make_folds
from pipeline.inputs.spec import load_spec
from pipeline.records.tracking import Tag

pytestmark = pytest.mark.e2e

ALL_HYPERPARAMETERS = {
    "batch_size",
    "learning_rate",
    "optimizer",
    "epochs",
    "clipping",
    "conv_layers",
    "filters",
    "kernel_size",
    "dropout",
}  # and clip_threshold, where clipping is on

FAILS_ON_BAD = """
import keras

def build(hp):
    if hp.Choice("mode", ["ok", "bad"]) == "bad":
        raise RuntimeError("this config cannot be built")
    inputs = keras.Input((40, 1))
    x = keras.layers.Conv1D(4, 3, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax")(keras.layers.Flatten()(x))
    return keras.Model(inputs, outputs)
"""


def test_sweep_records_one_parent_and_a_finished_child_per_trial(recorded_sweep):
    """The session's recorded sweep (conftest.py): 4 trials, 2 folds, 2 epochs, one trial NaN."""
    assert recorded_sweep.exit_code == 0, recorded_sweep.output
    output = recorded_sweep.output
    assert "leaderboard" in output
    assert f"ui diverging --tracking-uri {recorded_sweep.uri}" in output.replace("\n", "")
    assert "viewStateShareKey=" in output
    tracker, parents, trials = recorded_sweeps(recorded_sweep.uri, "diverging")
    assert len(parents) == 1 and len(trials) == 4
    parent = parents[0]
    assert parent.state == "FINISHED" and parent.tags[Tag.STATUS] == "ok"
    assert parent.metrics["n_trials"] == 4 and parent.metrics["n_failed"] == 0

    artifacts = set(tracker.artifact_paths(parent.run_id))
    assert {"spec.yaml", "fold_manifest.json"} <= artifacts
    directory = recorded_sweep.directory
    manifest = json.loads(tracker.artifact_file(parent.run_id, "fold_manifest.json", directory).read_text())
    spec = load_spec(directory / "spec.yaml")
    assert manifest == make_folds(spec.cv, load_dataset(spec.resolved_dataset())).manifest()

    scores = []
    for trial in trials:
        assert trial.tags[Tag.PARENT] == parent.run_id
        clipped = trial.params["clipping"] != "none"
        assert set(trial.params) == ALL_HYPERPARAMETERS | ({"clip_threshold"} if clipped else set())
        if trial.tags[Tag.STATUS] != "ok":
            assert trial.tags[Tag.STATUS] == "nan" and trial.params["learning_rate"] == "50.0"
            continue  # the NaN trial (test_record_e2e)
        assert trial.state == "FINISHED"
        history = {
            key: tracker.metric_histories([trial.run_id], key)[trial.run_id]
            for key in ("mean_val_accuracy", "split0_val_accuracy", "split1_val_accuracy")
        }
        assert [step for step, _ in history["mean_val_accuracy"]] == [1, 2]
        for epoch in range(2):
            folds = [history[f"split{k}_val_accuracy"][epoch][1] for k in range(2)]
            assert history["mean_val_accuracy"][epoch][1] == pytest.approx(np.mean(folds))
        assert "std_val_accuracy" in trial.metrics and "mean_train_loss" in trial.metrics
        assert trial.metrics["train_samples_per_s"] > 0 and trial.metrics["trial_wall_s"] > 0
        scores.append(trial.metrics["mean_val_accuracy"])
    assert len(scores) == 3
    assert parent.metrics["best_mean_val_accuracy"] == pytest.approx(max(scores))
    assert parent.tags[Tag.BEST_RUN_ID] in {trial.run_id for trial in trials}


def test_a_failing_trial_is_recorded_and_a_gpu_request_without_gpus_runs_on_cpu(
    ray_cluster, tmp_path, write_spec, empty_store, write_experiment, monkeypatch
):
    """One sweep for two things a sweep survives: a trial whose build raises (recorded as failed,
    the sweep completes) and resources.gpu on a cluster without GPUs (a notice, trials on CPU)."""
    monkeypatch.chdir(tmp_path)
    experiment = write_experiment(FAILS_ON_BAD)
    spec_path = write_spec(
        {
            "experiment": f"{experiment}:build",
            "name": "failing",
            "resources": {"gpu": 0.5},
            "search": {"num_samples": 1, "space": Replace({"mode": {"grid": ["ok", "bad"]}})},
            "train": {"epochs": 1},
        }
    )

    result = CliRunner().invoke(app, ["run", str(spec_path)])

    assert result.exit_code == 0, result.output
    assert "notice: resources.gpu=0.5 but the Ray cluster has no GPU: trials run on CPU" in result.output.replace(
        "\n", " "
    )
    tracker, parents, trials = recorded_sweeps(f"sqlite:///{tmp_path / 'mlflow.db'}", "failing")
    by_mode = {trial.params["mode"]: trial for trial in trials}
    assert set(by_mode) == {"ok", "bad"}
    assert by_mode["ok"].state == "FINISHED" and by_mode["ok"].tags[Tag.STATUS] == "ok"
    assert "CPU" in by_mode["ok"].tags[Tag.of("device")]
    assert by_mode["bad"].state == "FAILED" and by_mode["bad"].tags[Tag.STATUS] == "error"
    assert "this config cannot be built" in by_mode["bad"].tags[Tag.ERROR]
    assert parents[0].metrics["n_trials"] == 2
    assert parents[0].metrics["n_failed"] == 1
