"""KerasTuner hypermodels as researchers write them run unchanged: no Input layer, a subclassed
model, their own compile (optimizer, searched learning rate, categorical loss on integer labels),
hyperparameters inside a loop, and a HyperModel.fit that tunes the batch size."""

from __future__ import annotations

import re

import pytest
from helpers import REPO, TINY_SPEC, Replace, curve, latest_sweep, merged
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.records.tracking import Tag

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("empty_store")]

STYLES = REPO / "tests" / "experiments" / "kerastuner_styles.py"


def sweep(tmp_path, name: str, attr: str, space: dict, num_samples: int = 1, jit_compile: bool | str = "auto"):
    import yaml

    spec = merged(
        TINY_SPEC,
        {
            "name": name,
            "train": {"jit_compile": jit_compile},
            "experiment": f"{STYLES}:{attr}",
            "search": {"num_samples": num_samples, "space": Replace(space)},
            "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        },
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    checked = CliRunner().invoke(app, ["validate", str(path)])
    assert checked.exit_code == 0, checked.output
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 0, result.output
    tracker, _, trials = latest_sweep(f"sqlite:///{tmp_path / 'mlflow.db'}", name)  # oldest first
    assert trials and all(run.state == "FINISHED" and run.tags[Tag.STATUS] == "ok" for run in trials), [
        run.tags.get(Tag.ERROR) for run in trials
    ]
    return tracker, trials, checked.output


def test_a_sequential_without_input_its_own_compile_and_units_inside_a_loop(ray_cluster, tmp_path):
    """One sweep of a Sequential with no Input shows both: the hypermodel's own compile (its
    optimizer, its searched learning rate, a categorical loss on integer labels) and hidden
    layers whose units are searched inside a loop and recorded only when built."""
    space = {"num_layers": {"grid": [1, 3]}, "units_0": 32, "dropout": False, "lr": {"grid": [0.0001, 0.01]}}
    tracker, trials, validated = sweep(tmp_path, "own-compile", "sequential_no_input", space)
    assert "the Adam optimizer and loss that" in validated
    assert len(trials) == 4
    for run in trials:
        # The learning rate recorded is the one the hypermodel's optimizer trained with.
        assert float(run.params["learning_rate"]) == pytest.approx(float(run.params["lr"]), rel=1e-6)
        assert run.params["optimizer"] == "adam"
        assert run.tags[Tag.of("compile_source")] == "hypermodel"
        assert run.tags[Tag.of("loss")] == "categorical_crossentropy"
    by_config = {(run.params["num_layers"], float(run.params["lr"])): run for run in trials}
    assert len(by_config) == 4
    slow, fast = (
        curve(f"sqlite:///{tmp_path / 'mlflow.db'}", by_config["1", lr].run_id, "split0_train_loss")
        for lr in (0.0001, 0.01)
    )
    assert slow != pytest.approx(fast, rel=1e-3), "the hypermodel's learning rate changes training"
    for lr in (0.0001, 0.01):
        assert not {"units_1", "units_2"} & set(by_config["1", lr].params)
        deep = by_config["3", lr]
        units = [int(deep.params[f"units_{i}"]) for i in range(3)]
        summary = tracker.artifact_file(deep.run_id, "model_summary.txt", tmp_path / deep.run_id)
        widths = [int(width) for width in re.findall(r"Dense\)\s+│\s+\(None, (\d+)\)", open(summary).read())]
        assert widths[:3] == units, "each hidden layer has its recorded width"


def test_a_spec_learning_rate_replaces_the_hypermodels_and_validate_says_so(ray_cluster, tmp_path):
    space = {"num_layers": 1, "units_0": 32, "dropout": False, "lr": 0.0001, "learning_rate": 0.005}
    _, trials, validated = sweep(tmp_path, "spec-lr", "sequential_no_input", space)
    assert "search.space.learning_rate replaces the learning rate of the Adam optimizer" in validated.replace("\n", " ")
    assert float(trials[0].params["learning_rate"]) == 0.005


def test_a_subclassed_model(ray_cluster, tmp_path):
    _, trials, _ = sweep(tmp_path, "subclassed", "subclassed", {"units": 32, "batch_size": 8}, jit_compile=True)
    assert trials[0].tags[Tag.of("compile_source")] == "default"
    # Its folds train side by side: a subclassed model has no layer graph to stack.
    assert "side by side (not stacked: the model has no layer graph" in trials[0].tags[Tag.of("fused_reason")]


def test_a_hypermodel_fit_that_tunes_the_batch_size(ray_cluster, tmp_path):
    _, trials, validated = sweep(tmp_path, "fit", "TunedFit", {"units": 16, "shuffle": {"grid": [False, True]}})
    assert f"batch_size comes from {STYLES}:TunedFit's fit() (hyperparameter 'batch_size')" in validated
    assert f"shuffle comes from {STYLES}:TunedFit's fit() (hyperparameter 'shuffle')" in validated
    assert {run.params["batch_size"] for run in trials} <= {"8", "16"}
    assert sorted(run.params["shuffle"] for run in trials) == ["False", "True"]


def test_a_fit_that_preprocesses_is_refused(tmp_path, write_spec):
    spec = write_spec({"experiment": f"{STYLES}:Preprocessing", "search": {"space": Replace({})}})
    result = CliRunner().invoke(app, ["validate", str(spec)])
    assert result.exit_code == 2, result.output
    assert (
        "Preprocessing: its HyperModel.fit passes model.fit 1 thing foldsweep cannot honour: (1) other x than it was given"
        in result.output.replace("\n", " ")
    )
