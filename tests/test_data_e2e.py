"""The shipped protein and digits sweeps, run end to end in CI-sized form."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import REPO, merged, recorded_sweeps, write_image_folder
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.records.tracking import Tag

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("empty_store")]


def ci_sized(name: str, tmp_path: Path, overrides: dict) -> Path:
    """The repository's spec with small dataset parameters and few epochs, stored in tmp_path."""
    spec = yaml.safe_load((REPO / "sweeps" / name).read_text())
    spec["experiment"] = str(REPO / spec["experiment"])
    spec = merged(spec, {**overrides, "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}})
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return path


def recorded(tmp_path: Path, experiment: str):
    _, parents, trials = recorded_sweeps(f"sqlite:///{tmp_path / 'mlflow.db'}", experiment)
    return trials, parents[0]


def test_protein_batch_clip_sweep_runs_with_group_cv(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = ci_sized(
        "protein_batch_clip.yaml",
        tmp_path,
        # Two epochs: ASHA's grace period must stay below them to be able to act.
        {
            "dataset": {"name": "protein_windows", "n_proteins": 12},  # 10 to cross-validate
            "train": {"epochs": 2},
            "search": {"scheduler": {"grace_period": 1}},
            "resources": {"max_concurrent": 1},
        },
    )

    result = CliRunner().invoke(app, ["run", str(spec), "--num-samples", "2"])

    assert result.exit_code == 0, result.output
    trials, parent = recorded(tmp_path, "protein-batch-clip")
    assert len(trials) == 2
    # ASHA's one rung (epoch 1 of 2) cannot stop the first trial to reach it; seeded, neither goes NaN.
    assert sorted(run.tags[Tag.STATUS] for run in trials) in (["ok", "ok"], ["ok", "pruned"])
    assert parent.params["cv.splitter"] == "group"
    for run in trials:
        assert run.params["batch_size"] in {"4", "8", "16", "32", "64"}
        assert {"batch_norm", "conv_layers", "filters", "kernel_size", "dropout"} <= set(run.params)


def test_digits_sweep_runs_a_2d_cnn(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = ci_sized(
        "digits.yaml", tmp_path, {"cv": {"n_splits": 3}, "train": {"epochs": 3}, "resources": {"max_concurrent": 1}}
    )

    result = CliRunner().invoke(app, ["run", str(spec), "--num-samples", "1"])

    assert result.exit_code == 0, result.output
    trials, parent = recorded(tmp_path, "digits")
    assert len(trials) == 1 and trials[0].state == "FINISHED"
    assert trials[0].metrics["mean_val_accuracy"] > 0.5  # well above chance (0.1)
    assert 0 < parent.metrics["test_accuracy"] <= 1


def test_the_images_sweep_trains_its_augmented_cnn_on_an_image_folder(ray_cluster, tmp_path, monkeypatch):
    """sweeps/images.yaml on a folder of class subfolders of PNGs (Keras' layout, made from the
    built-in shapes): the class names are recorded with the sweep, the augmentation layers draw
    foldsweep's numbers, the step runs without XLA on CPU (the model convolves images), and the
    CNN learns."""
    from pipeline.inputs.datasets import load_dataset
    from pipeline.inputs.spec import DatasetSpec

    shapes = load_dataset(DatasetSpec(name="shapes", options={"num_samples": 1500}))
    names = ["disk", "ring", "square", "outline", "triangle", "plus", "cross", "hstripes", "vstripes", "checker"]
    write_image_folder(tmp_path / "photos" / "train", shapes.x, shapes.y, names)
    write_image_folder(tmp_path / "photos" / "test", shapes.x_test, shapes.y_test, names)
    monkeypatch.chdir(tmp_path)
    spec = ci_sized(
        "images.yaml",
        tmp_path,
        {
            "dataset": {"images": str(tmp_path / "photos")},
            "cv": {"n_splits": 2},
            "search": {"space": {"width": 16, "conv_blocks": 2, "dropout": 0.2, "learning_rate": 0.003}},
            "train": {"epochs": 6, "refit": False},
            "resources": {"max_concurrent": 1},
        },
    )

    result = CliRunner().invoke(app, ["run", str(spec), "--num-samples", "1"])

    assert result.exit_code == 0, result.output
    trials, parent = recorded(tmp_path, "images")
    assert len(trials) == 1 and trials[0].state == "FINISHED"
    assert parent.params["dataset_classes"] == ",".join(sorted(names))
    assert trials[0].tags["foldsweep.random_draws"] == "counter"
    assert trials[0].tags["foldsweep.jit_compile"] == "False"
    assert trials[0].metrics["mean_val_accuracy"] > 0.25, trials[0].metrics  # well above chance (0.1)
