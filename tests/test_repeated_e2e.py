"""Repeated CV through real sweeps: replicas, p-values against the best, the epoch a trial is scored at."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import MNIST1D_EXPERIMENT, history, latest_sweep, seed_store
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.inputs.datasets import load_dataset
from pipeline.inputs.folds import make_folds, manifest_identity
from pipeline.inputs.spec import DatasetSpec, load_spec
from pipeline.records.tracking import DESCRIPTION_TAG, Tag

pytestmark = pytest.mark.e2e


def run(spec: dict, directory: Path) -> tuple[str, str]:
    path = directory / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = CliRunner().invoke(app, ["run", str(path)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return str(path), result.output


@pytest.fixture(scope="module")
def grouped_repeated_sweep(ray_cluster, tmp_path_factory):
    """2 x 3-fold group CV on a data file with groups; a grid of a working learning rate and a
    broken one (1e-7), each run twice with the same seeds. Batches of 16 stack the six folds into
    one XLA program; at batch 32 they run side by side, six models in the program, and a one-epoch
    `foldsweep trial` took 17.6 s instead of 8.8 s, most of it compiling."""
    directory = tmp_path_factory.mktemp("repeated")
    mnist = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 800}))
    groups = np.arange(len(mnist.y)) // 4  # 4 samples per group
    np.savez(directory / "grouped.npz", x=mnist.x, y=mnist.y, groups=groups)
    uri = f"sqlite:///{seed_store(directory / 'mlflow.db')}"
    spec = {
        "name": "grouped-repeated",
        "experiment": f"{MNIST1D_EXPERIMENT}:build",
        "dataset": "grouped.npz",
        "cv": {"splitter": "group", "n_splits": 3, "n_repeats": 2, "seed": 0},
        # Each learning rate twice, as two configs that train alike (a sweep never trains one config
        # twice): without clipping, and clipping gradients at a bound none reaches.
        "search": {
            "num_samples": 1,
            "seed": 0,
            "space": {
                "learning_rate": {"grid": [0.01, 1e-7]},
                "clipping": {"grid": ["none", "value"]},
                "clip_threshold": 1e9,
                "batch_size": 16,
                "conv_layers": 1,
                "filters": 16,
                "kernel_size": 3,
                "dropout": 0.0,
            },
        },
        "train": {"epochs": 5, "metric": "accuracy", "mode": "max", "seed": 0},
        "resources": {"cpu": 1, "max_concurrent": 1},
        "tracking": {"uri": uri},
    }
    path, output = run(spec, directory)
    return directory, uri, path, output


def test_two_repeats_of_three_folds_give_six_replicas_each_sample_validated_twice_groups_whole(grouped_repeated_sweep):
    directory, uri, path, _ = grouped_repeated_sweep
    tracker, parent, trials = latest_sweep(uri, "grouped-repeated")
    assert len(trials) == 4 and parent.params["cv.n_repeats"] == "2"
    manifest = json.loads(tracker.artifact_file(parent.run_id, "fold_manifest.json", directory).read_text())
    assert [(f["fold"], f["repeat"], f["fold_in_repeat"]) for f in manifest["folds"]] == [
        (j, j // 3, j % 3) for j in range(6)
    ]
    spec = load_spec(Path(path))
    dataset = load_dataset(spec.resolved_dataset())
    folds = make_folds(spec.cv, dataset)
    assert manifest_identity(folds.manifest()) == manifest_identity(manifest)  # what the trials trained on
    validated = np.bincount(np.concatenate([fold.val for fold in folds.folds]), minlength=len(dataset.y))
    assert validated.tolist() == [2] * len(dataset.y)
    for fold in folds.folds:
        assert np.intersect1d(dataset.groups[fold.train], dataset.groups[fold.val]).size == 0
    for trial in trials:
        assert {f"split{j}_val_accuracy" for j in range(6)} <= set(trial.metrics)
        assert "split6_val_accuracy" not in trial.metrics
        replicas = [trial.metrics[f"selected_split{j}_val_accuracy"] for j in range(6)]
        assert trial.metrics["selected_mean_val_accuracy"] == pytest.approx(np.mean(replicas))

    with tracker.artifact_file(parent.run_id, "cv_results.csv", directory).open() as handle:
        rows = list(csv.DictReader(handle))
    columns = list(rows[0])
    assert [c for c in columns if c.endswith("_val_accuracy") and c.startswith("split")] == [
        f"split{j}_val_accuracy" for j in range(6)
    ]
    assert {"pvalue_vs_best", "tied_with_best", "best_epoch"} <= set(columns)


def test_configs_that_train_alike_are_tied_and_a_broken_learning_rate_is_significantly_worse(grouped_repeated_sweep):
    directory, uri, _, output = grouped_repeated_sweep
    tracker, parent, trials = latest_sweep(uri, "grouped-repeated")
    with tracker.artifact_file(parent.run_id, "cv_results.csv", directory).open() as handle:
        rows = {row["run_id"]: row for row in csv.DictReader(handle)}
    working = [rows[t.run_id] for t in trials if t.params["learning_rate"] == "0.01"]
    broken = [rows[t.run_id] for t in trials if t.params["learning_rate"] == "1e-07"]
    assert sorted(row["rank_val_accuracy"] for row in working) == ["1", "1"]  # equal scores share rank 1
    assert all(float(row["pvalue_vs_best"]) > 0.5 and row["tied_with_best"] == "True" for row in working)
    assert all(float(row["pvalue_vs_best"]) < 0.05 and row["tied_with_best"] == "False" for row in broken)
    assert {run.tags[Tag.PVALUE_VS_BEST] for run in trials if run.params["learning_rate"] == "0.01"} == {"1"}
    assert parent.metrics["n_tied_with_best"] == 1
    line = "1 of the 3 other ranked trials is statistically indistinguishable from the best"
    assert line in output.replace("\n", " ")
    description = parent.tags[DESCRIPTION_TAG]
    assert line in description and "worse (p=" in description

    report = CliRunner().invoke(app, ["report", "grouped-repeated", "--tracking-uri", uri], env={"COLUMNS": "250"})
    assert report.exit_code == 0, report.output
    assert line in report.output and "tied (p=1.00)" in report.output


# Enough epochs of the wide CNN below for its validation loss to turn up: it is lowest at epoch 3.
OVERFIT_EPOCHS = 8


def overfitting_spec(directory: Path, select: str) -> dict:
    """80 training samples, 2 folds, a wide CNN: the validation loss turns up early."""
    return {
        "name": f"overfit-{select}",
        "experiment": f"{MNIST1D_EXPERIMENT}:build",
        "dataset": {"name": "mnist1d", "num_samples": 100},
        "cv": {"splitter": "stratified", "n_splits": 2, "seed": 0},
        "search": {
            "algorithm": "grid",
            "num_samples": 1,
            "seed": 0,
            "space": {
                "learning_rate": {"grid": [0.01, 0.003]},
                "batch_size": 8,
                "conv_layers": 2,
                "filters": 64,
                "kernel_size": 5,
                "dropout": 0.0,
            },
        },
        "train": {"epochs": OVERFIT_EPOCHS, "metric": "loss", "mode": "min", "seed": 0, "select": select},
        "resources": {"cpu": 1, "max_concurrent": 1},
        "tracking": {"uri": f"sqlite:///{directory / 'mlflow.db'}"},
    }


def test_an_overfitting_trial_is_scored_and_refit_at_its_best_epoch_and_select_last_restores_the_old_ranking(
    ray_cluster, tmp_path, empty_store
):
    uri = f"sqlite:///{empty_store}"
    _, output = run(overfitting_spec(tmp_path, "best_epoch"), tmp_path)
    tracker, parent, trials = latest_sweep(uri, "overfit-best_epoch")
    curves = {trial.run_id: history(uri, trial.run_id, "mean_val_loss") for trial in trials}
    for trial in trials:
        curve = curves[trial.run_id]
        best_epoch = int(trial.metrics["best_epoch"])
        assert (
            len(curve) == OVERFIT_EPOCHS and best_epoch < OVERFIT_EPOCHS
        )  # it overfits: the curve turns up before the end
        assert best_epoch == min(curve, key=lambda epoch: (curve[epoch], epoch))
        assert trial.metrics["selected_mean_val_loss"] == curve[best_epoch]
        assert trial.metrics["selected_mean_val_loss"] < trial.metrics["mean_val_loss"]  # the last epoch's
    best = min(trials, key=lambda trial: min(curves[trial.run_id].values()))
    assert parent.tags[Tag.BEST_RUN_ID] == best.run_id
    assert parent.metrics["best_mean_val_loss"] == min(curves[best.run_id].values())
    assert parent.metrics["refit_epochs"] == best.metrics["best_epoch"]
    assert f"({int(best.metrics['best_epoch'])} epochs)" in output
    leaderboard = next(line for line in output.splitlines() if best.run_id[:8] in line and "│    1 │" in line)
    assert f"{min(curves[best.run_id].values()):.4f}" in leaderboard

    _, output = run(overfitting_spec(tmp_path, "last"), tmp_path)
    tracker, parent, trials = latest_sweep(uri, "overfit-last")
    last = {trial.run_id: history(uri, trial.run_id, "mean_val_loss")[OVERFIT_EPOCHS] for trial in trials}
    assert all(trial.metrics["best_epoch"] == OVERFIT_EPOCHS for trial in trials)
    assert all(trial.metrics["selected_mean_val_loss"] == last[trial.run_id] for trial in trials)
    best_last = min(trials, key=lambda trial: last[trial.run_id])
    assert parent.tags[Tag.BEST_RUN_ID] == best_last.run_id
    assert parent.metrics["refit_epochs"] == OVERFIT_EPOCHS and f"({OVERFIT_EPOCHS} epochs)" in output


def test_a_rerun_trains_every_replica_of_a_repeated_trial_and_reproduces_it(grouped_repeated_sweep, monkeypatch):
    """The refusal runs in this process (it ends before TensorFlow); the rerun in a fresh one,
    whose thread pools are the trial's, so that it reproduces the trial to rel 1e-6."""
    from helpers import foldsweep

    directory, uri, _, _ = grouped_repeated_sweep
    tracker, parent, trials = latest_sweep(uri, "grouped-repeated")
    trial = tracker.trial_record(parent.tags[Tag.BEST_RUN_ID])
    monkeypatch.chdir(directory)
    refused = CliRunner().invoke(
        app, ["rerun", trial.run_id, "--tracking-uri", uri, "--fold", "6"], env={"COLUMNS": "250"}
    )
    assert refused.exit_code == 2
    assert "--fold must be between 0 and 5 (the sweep's trials train 6 folds (2 repeats x 3)), got 6" in refused.output
    ran = foldsweep("rerun", trial.run_id, "--tracking-uri", uri, cwd=directory)
    assert ran.exit_code == 0, ran.output
    (rerun,) = tracker.reruns(trial.run_id)
    for j in range(6):
        key = f"split{j}_val_loss"
        recorded, again = history(uri, trial.run_id, key), history(uri, rerun.run_id, key)
        assert len(recorded) == 5 and again.keys() == recorded.keys()
        assert all(again[epoch] == pytest.approx(recorded[epoch], rel=1e-6) for epoch in recorded)
    assert rerun.metrics["best_epoch"] == trial.metrics["best_epoch"]
