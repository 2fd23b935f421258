"""The checks of a spec's inputs that need no model: grouped data split with its groups kept whole
(or ignored on purpose, and recorded so), and every data error reported before TensorFlow loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import REPO
from typer.testing import CliRunner

from pipeline.base.errors import SpecError
from pipeline.checks import check_inputs, make_checked_folds
from pipeline.cli import app
from pipeline.inputs.spec import load_spec

MODEL = (
    "import keras\ndef build(hp):\n"
    "    return keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(2, activation='softmax')])\n"
)


def grouped_workspace(directory: Path, cv: dict) -> Path:
    """60 samples in 12 groups of 5 near-copies (windows of one protein, say), and a spec."""
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(12), 5)
    x = (rng.normal(size=(12, 8, 1))[groups] + 0.01 * rng.normal(size=(60, 8, 1))).astype(np.float32)
    np.savez(directory / "grouped.npz", x=x, y=(groups % 2).astype(np.int32), groups=groups)
    (directory / "model.py").write_text(MODEL)
    spec = directory / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "grouped",
                "experiment": "model.py",
                "dataset": "grouped.npz",
                "cv": {"n_splits": 2, **cv},
                "search": {"space": {"batch_size": 8}},
                "tracking": {"uri": f"sqlite:///{directory / 'mlflow.db'}"},
            }
        )
    )
    return spec


@pytest.mark.parametrize("splitter", ["stratified", "kfold"])
def test_grouped_data_split_without_its_groups_is_refused_before_anything_runs(
    without_ray, tmp_path, monkeypatch, splitter
):
    import ray

    spec = grouped_workspace(tmp_path, {"splitter": splitter})
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.iterdir())
    for command in ("validate", "run"):
        result = CliRunner().invoke(app, [command, str(spec)])
        output = " ".join(result.output.split())
        assert result.exit_code == 2, result.output
        assert (
            f"cv.splitter {splitter} ignores the groups of '{tmp_path / 'grouped.npz'}' (12 groups over 60 samples)"
        ) in output
        assert "use cv.splitter: group | stratified_group, or set cv.groups: ignore" in output
    assert sorted(tmp_path.iterdir()) == before and not ray.is_initialized()


def test_groups_ignored_on_purpose_are_accepted_and_recorded_with_the_sweep(tmp_path):
    from pipeline.checks import prepare
    from pipeline.records.tracking import Tracker
    from pipeline.sweep import _sweep_params

    spec = load_spec(grouped_workspace(tmp_path, {"splitter": "stratified", "groups": "ignore"}))
    prepared = prepare(spec)
    params = _sweep_params(prepared)
    assert params["cv.groups"] == "ignore" and params["cv.splitter"] == "stratified"
    tracker = Tracker(prepared.tracking_uri)
    parent_run_id, _ = tracker.start_sweep(
        name=spec.name,
        spec_text=spec.source_text,
        manifest=prepared.folds.manifest(),
        params=params,
        tags={},
        ray_path_for=lambda run_id: str(tmp_path / run_id),
    )
    assert tracker.find_sweep(spec.name).params["cv.groups"] == "ignore"
    assert parent_run_id == tracker.find_sweep(spec.name).run_id


def test_grouped_splitters_and_data_without_groups_need_no_opt_out(tmp_path):
    for splitter in ("group", "stratified_group"):
        spec = load_spec(grouped_workspace(tmp_path, {"splitter": splitter}))
        assert len(make_checked_folds(spec, check_inputs(spec))[0]) == 2
    spec = load_spec(grouped_workspace(tmp_path, {"splitter": "stratified", "groups": "ignore"}))
    data = dict(np.load(tmp_path / "grouped.npz"))
    np.savez(tmp_path / "grouped.npz", x=data["x"], y=data["y"])
    assert check_inputs(spec).warnings == (
        f"cv.groups: ignore has nothing to ignore: '{tmp_path / 'grouped.npz'}' has no groups",
    )
    with pytest.raises(SpecError, match="cv.groups ignore contradicts cv.splitter group"):
        load_spec(grouped_workspace(tmp_path, {"splitter": "group", "groups": "ignore"}))


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("case", ["a missing data file", "a misnamed label array", "-1/+1 labels"])
def test_a_data_error_is_reported_before_tensorflow_loads(tmp_path, case, command):
    """What needs no model is checked first: the command answers without importing TensorFlow
    (``run`` imports ``pipeline.sweep`` before it checks the spec)."""
    spec = grouped_workspace(tmp_path, {"splitter": "group"})
    data = dict(np.load(tmp_path / "grouped.npz"))
    expected = {
        "a missing data file": "dataset: file not found: 'absent.npz'",
        "a misnamed label array": "has no array 'y' (for y); its arrays are x, labels, groups",
        "-1/+1 labels": "for -1/+1 labels (FordA's, an SVM's) use 0/1: y = (y > 0).astype(int)",
    }[case]
    if case == "a missing data file":
        spec.write_text(spec.read_text().replace("grouped.npz", "absent.npz"))
    elif case == "a misnamed label array":
        np.savez(tmp_path / "grouped.npz", x=data["x"], labels=data["y"], groups=data["groups"])
    else:
        np.savez(tmp_path / "grouped.npz", x=data["x"], y=data["y"] * 2 - 1, groups=data["groups"])
    probe = (
        "import sys\nfrom typer.testing import CliRunner\nfrom pipeline.cli import app\n"
        f"result = CliRunner().invoke(app, [{command!r}, {str(spec)!r}])\n"
        "print(result.exit_code, 'tensorflow' in sys.modules, 'keras' in sys.modules)\nprint(result.output)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    first, output = done.stdout.split("\n", 1)
    assert first == "2 False False", done.stdout + done.stderr
    assert expected in " ".join(output.split())


def test_validate_says_whose_clipping_the_trials_train_with(write_spec):
    from types import SimpleNamespace

    import keras_tuner

    from pipeline.checks import compile_notes
    from pipeline.inputs.spec import load_spec

    experiment = SimpleNamespace(
        compiled_optimizer="SGD",
        compiled_schedule=None,
        compiled_clipping="clipnorm=0.01",
        fit_arguments={},
        fit_early_stopping=None,
        fit_restores_best_weights=False,
        hyperparameters=keras_tuner.HyperParameters(),
    )
    searched = load_spec(write_spec({"search": {"space": {"clipping": {"choice": ["none", "value"]}}}}))
    assert (
        "search.space.clipping replaces the clipnorm=0.01 of the SGD optimizer that "
        f"{searched.experiment} compiles: the trials clip as their clipping says, none not at all"
    ) in compile_notes(searched, experiment)
    unsearched = load_spec(write_spec())
    assert (
        "the SGD optimizer clips the gradients with its clipnorm=0.01; the trials' clipping param, none, is the "
        "spec's (search.space.clipping would replace it)"
    ) in compile_notes(unsearched, experiment)
    assert not [
        note
        for note in compile_notes(unsearched, SimpleNamespace(**{**vars(experiment), "compiled_clipping": None}))
        if "clip" in note
    ]


def test_validate_says_a_batch_size_the_build_declares_is_the_trials(write_spec):
    from types import SimpleNamespace

    import keras_tuner

    from pipeline.checks import compile_notes
    from pipeline.inputs.spec import load_spec

    hyperparameters = keras_tuner.HyperParameters()
    hyperparameters.Choice("batch_size", [8, 64])
    experiment = SimpleNamespace(
        compiled_optimizer=None,
        compiled_schedule=None,
        compiled_clipping=None,
        fit_arguments={},
        fit_early_stopping=None,
        hyperparameters=hyperparameters,
    )
    spec = load_spec(write_spec())
    assert f"batch_size is the hyperparameter {spec.experiment}'s build(hp) declares" in " ".join(
        compile_notes(spec, experiment)
    )
    named = load_spec(write_spec({"search": {"space": {"batch_size": 16}}}))
    assert not [note for note in compile_notes(named, experiment) if "batch_size" in note]


def test_validate_says_a_constant_the_fit_passes_replaces_the_specs(write_spec):
    from types import SimpleNamespace

    import keras_tuner

    from pipeline.checks import compile_notes
    from pipeline.inputs.spec import load_spec

    hyperparameters = keras_tuner.HyperParameters()
    hyperparameters.Fixed("epochs", 500)  # what the fit reader makes of fit(epochs=500)
    hyperparameters.Choice("batch_size", [16, 32])
    experiment = SimpleNamespace(
        compiled_optimizer=None,
        compiled_schedule=None,
        compiled_clipping=None,
        fit_arguments={"epochs": "epochs", "batch_size": "batch_size"},
        fit_early_stopping=None,
        hyperparameters=hyperparameters,
    )
    spec = load_spec(write_spec())
    notes = compile_notes(spec, experiment)
    assert f"epochs is 500, as {spec.experiment}'s fit() passes it (in place of train.epochs 2)" in notes
    assert f"batch_size comes from {spec.experiment}'s fit() (hyperparameter 'batch_size')" in notes
