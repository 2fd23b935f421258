"""`foldsweep rerun` and `foldsweep trial`: one trial in-process, reproducing what the sweep recorded."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO, TINY_SPEC, curve, foldsweep, latest_sweep, merged, runs_in_store, seed_store
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.inputs.datasets import load_dataset
from pipeline.inputs.spec import DatasetSpec
from pipeline.records.tracking import Tag

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def unclipped_trials(recorded_sweep):
    """The session's recorded sweep (conftest): its directory, tracker, unclipped trials by
    learning rate (0.01 trains, 50.0 goes NaN) and parent run."""
    assert recorded_sweep.exit_code == 0, recorded_sweep.output
    tracker, parent, trials = recorded_sweep.records()
    unclipped = {run.params["learning_rate"]: run for run in trials if run.params["clipping"] == "none"}
    return recorded_sweep.directory, tracker, unclipped, parent


@pytest.fixture
def rerun(monkeypatch, threads_kept):
    """`foldsweep rerun ... --tracking-uri <the store>` in this process, from the store's directory.
    Here the reruns' thread pools are the suite's (a fresh process is what
    test_rerun_fidelity_e2e tests): their numbers match the sweep's to rel 1e-4, not to the bit."""

    def run(directory: Path, *args: str):
        monkeypatch.chdir(directory)
        return CliRunner().invoke(
            app, ["rerun", *args, "--tracking-uri", f"sqlite:///{directory / 'mlflow.db'}"], env={"COLUMNS": "200"}
        )

    return run


def test_rerun_of_a_finished_trial_reproduces_its_fold_losses_and_is_recorded_apart(unclipped_trials, rerun):
    from mlflow import MlflowClient

    directory, tracker, trials, parent = unclipped_trials
    store = f"sqlite:///{directory / 'mlflow.db'}"
    original = trials["0.01"]
    assert original.state == "FINISHED"
    runs_before = runs_in_store(store, parent.name)

    result = rerun(directory, original.run_id)

    assert result.exit_code == 0, result.output
    assert "epoch 1: fold 0" in result.output and "epoch 2: fold 0" in result.output
    # The layout follows this process' compute threads; either way the folds train fused, as
    # many steps per launch as the trial did.
    steps = original.tags[Tag.of("steps_per_launch")]
    assert re.search(
        rf"fused: 2 folds in one execution[^;\n]*(stacked|side by side)[^\n]*; steps per launch: {steps}\b",
        result.output,
    ), result.output
    reruns = tracker.reruns(original.run_id)
    assert len(reruns) == 1
    again = reruns[0]
    assert again.state == "FINISHED" and again.tags[Tag.ROLE] == "rerun"
    # Where it came from and the data it trained on, as the trial it reruns records them (the
    # command's own name, in a process of its own: test_newcomer_e2e).
    assert again.tags["mlflow.source.git.commit"] == original.tags["mlflow.source.git.commit"]
    (trained_on,) = MlflowClient(store).get_run(again.run_id).inputs.dataset_inputs  # MLflow's own reading
    assert (
        trained_on.dataset.digest
        == MlflowClient(store).get_run(original.run_id).inputs.dataset_inputs[0].dataset.digest
    )
    for k in (0, 1):
        for key in (f"split{k}_val_loss", f"split{k}_val_accuracy", f"split{k}_train_loss"):
            assert curve(store, again.run_id, key) == pytest.approx(
                curve(store, original.run_id, key), rel=1e-4, abs=1e-6
            )
    # The original is untouched, and nothing but the rerun was added.
    assert tracker.trial_record(original.run_id).metrics == original.metrics
    assert runs_in_store(store, parent.name) == runs_before + 1


def test_rerun_profile_says_where_a_steady_epoch_goes_and_keeps_its_trace(unclipped_trials, tmp_path):
    """`rerun --profile` in a fresh process (XLA marks its ops only if told before
    TensorFlow starts), as a researcher runs it."""
    directory, tracker, trials, parent = unclipped_trials
    original = trials["0.01"]
    ran = foldsweep(
        "rerun",
        original.run_id,
        "--profile",
        "--tracking-uri",
        f"sqlite:///{directory / 'mlflow.db'}",
        cwd=tmp_path,
    )
    assert ran.exit_code == 0, ran.output
    assert re.search(r"differs from the trial: [^\n]*--profile \(TensorFlow's profiler around epoch 2", ran.output)
    trace = Path(re.search(r"trace: (\S+\.xplane\.pb);", ran.output).group(1))
    trace = trace if trace.is_absolute() else tmp_path / trace
    assert trace.is_file() and trace.stat().st_size > 0
    assert trace.is_relative_to(tmp_path / "profiles") and "plugins/profile" in trace.as_posix()
    # The epoch's wall clock, measured by the trial's clock, against its parts: training and
    # validation as the trace marks them, the gap before them as the clock measured it.
    wall, train, validation, gap = (
        float(value)
        for value in re.search(
            r"profile of epoch 2: its wall clock ([\d.]+) s = training launches ([\d.]+) s \([^)]*\), validation "
            r"([\d.]+) s \([^)]*\), gap before the epoch ([\d.]+) s",
            ran.output,
        ).groups()
    )
    assert train > 0 and validation > 0
    assert train + validation + gap == pytest.approx(wall, rel=0.10)
    top = ran.output.split("top operations by self time")[1].split("no operation runs")[0]
    assert "conv" in top.lower(), top
    assert re.search(r"no operation runs for \d+% of the training", ran.output)
    assert "xprof --logdir=" in ran.output
    rerun_run = tracker.reruns(original.run_id)[0]
    assert "--profile" in rerun_run.tags[Tag.RERUN_DIFFERS]
    listed = tracker.artifact_paths(rerun_run.run_id, "profile/plugins/profile")
    assert len(listed) == 1
    assert any(path.endswith(".xplane.pb") for path in tracker.artifact_paths(rerun_run.run_id, listed[0]))
    # The rerun's own record holds its account; the trial's is untouched.
    assert rerun_run.metrics["trial_wall_s"] > 0 and "gap_s" in rerun_run.metrics
    assert tracker.trial_record(original.run_id).metrics == original.metrics


def test_rerun_one_fold_with_fewer_epochs_without_tracking(unclipped_trials, rerun):
    directory, tracker, trials, parent = unclipped_trials
    original = trials["0.01"]
    store = f"sqlite:///{directory / 'mlflow.db'}"
    runs_before = runs_in_store(store, parent.name)
    result = rerun(directory, original.run_id, "--fold", "1", "--epochs", "1", "--no-track", "--eager")
    assert result.exit_code == 0, result.output
    assert "epoch 1: fold 1 " in result.output and "fold 0" not in result.output and "epoch 2" not in result.output
    assert "unfused: one fold to train" in result.output
    # The sweep trained the folds fused; this single fold, eager and unfused, still matches it.
    assert runs_in_store(store, parent.name) == runs_before
    recorded = curve(store, original.run_id, "split1_val_loss")[0]
    shown = float(result.output.split("val_loss ")[1].split()[0])
    assert shown == pytest.approx(recorded, rel=1e-3)


def test_check_numerics_places_a_nan_trials_overflowing_gradient_norm_in_its_fold_epoch_step_and_layer(
    unclipped_trials, rerun, monkeypatch
):
    """lr 50 unclipped: the first non-finite value is foldsweep's own gradient norm. The rerun names
    the variable whose gradient's squares overflowed first and its layer, one of the NaN fold's
    model, and the fold, epoch and step the recorded trial went NaN at (the divergence is
    explosive: without XLA it goes NaN at the same step)."""
    import pipeline.rerun

    directory, tracker, trials, _ = unclipped_trials
    nan_trial = trials["50.0"]
    assert nan_trial.tags[Tag.STATUS] == "nan"
    recorded = {key: nan_trial.tags[Tag.of(f"nan_{key}")] for key in ("fold", "epoch", "step")}
    stopped = []

    def placed(message, stopped_call):  # the real reading; what it was placed in is kept
        stopped.append(stopped_call)
        return numerics_finding(message, stopped_call)

    numerics_finding = pipeline.rerun.numerics_finding
    monkeypatch.setattr(pipeline.rerun, "numerics_finding", placed)

    result = rerun(directory, nan_trial.run_id, "--check-numerics")

    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())  # the console wraps long lines
    place = f"fold {recorded['fold']}, epoch {recorded['epoch']}, step {recorded['step']}"
    assert (
        f"first non-finite value: {place}: the gradient norm, foldsweep's own check of each step (op L2Loss, "
        "node global_norm/L2Loss"
    ) in output
    assert f"the recorded trial went NaN at the same place ({place}: its tags {Tag.of('nan_fold')}" in output
    again = tracker.reruns(nan_trial.run_id)[0]
    tags = again.tags
    assert tags[Tag.STATUS] == "nan" and tags[Tag.NUMERICS_OP] == "L2Loss"
    assert {key: tags[Tag.of(f"numerics_{key}")] for key in ("fold", "epoch", "step")} == recorded
    assert re.fullmatch(r"global_norm/L2Loss(_\d+)?", tags[Tag.NUMERICS_NODE])
    # The layer and variable are the NaN fold's model's own (never the norm's scope, global_norm).
    (call,) = stopped
    assert str(call.fold) == recorded["fold"]
    layers = {f"{layer.name} ({type(layer).__name__})": layer for layer in call.model.layers}
    layer = layers[tags[Tag.NUMERICS_LAYER]]
    assert tags[Tag.NUMERICS_VARIABLE] in {variable.path for variable in layer.trainable_variables}
    assert (
        f"the gradient of {tags[Tag.NUMERICS_VARIABLE]}, a variable of layer "
        f"{tags[Tag.NUMERICS_LAYER]}, is the first whose sum of squares is not finite" in output
    )


def test_set_reruns_the_nan_trial_with_clipping(unclipped_trials, rerun):
    directory, tracker, trials, _ = unclipped_trials
    nan_trial = trials["50.0"]
    result = rerun(directory, nan_trial.run_id, "--set", "clipping=global_norm", "--set", "clip_threshold=0.1")
    assert result.exit_code == 0, result.output
    assert "status: ok" in result.output
    again = next(run for run in tracker.reruns(nan_trial.run_id) if run.params["clipping"] == "global_norm")
    assert again.params["clip_threshold"] == "0.1" and again.params["learning_rate"] == "50.0"
    assert again.tags[Tag.STATUS] == "ok"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["0123456789abcdef0123456789abcdef"], "RUN_ID: no trial run with id '0123456789abcdef0123456789abcdef'"),
        (["PARENT"], f"is not a foldsweep trial (tag {Tag.ROLE}='sweep')"),
        (["TRIAL", "--fold", "2"], "--fold must be between 0 and 1 (the sweep's trials train 2 folds), got 2"),
        (["TRIAL", "--set", "fliters=3"], "--set fliters: not a hyperparameter of this trial"),
        (["TRIAL", "--set", "filters"], "--set must be name=value, got 'filters'"),
        (
            ["TRIAL", "--profile-epoch", "3"],
            "--profile-epoch must be between 1 and 2 (the trial trains 2 epochs), got 3",
        ),
        (
            ["TRIAL", "--profile", "--epochs", "1", "--profile-epoch", "2"],
            "--profile-epoch must be between 1 and 1 (the trial trains 1 epoch), got 2",
        ),
    ],
)
def test_bad_rerun_requests_exit_2(unclipped_trials, rerun, args, message):
    directory, _, trials, parent = unclipped_trials
    args = [{"PARENT": parent.run_id, "TRIAL": trials["0.01"].run_id}.get(arg, arg) for arg in args]
    result = rerun(directory, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output.replace("\n", " ")


def test_changed_data_is_refused(unclipped_trials, rerun):
    directory, _, trials, _ = unclipped_trials
    path = directory / "data.npz"
    original = path.read_bytes()
    with np.load(path) as stored:
        arrays = {key: stored[key] for key in stored.files}
    arrays["x"][0, 0, 0] += 1.0
    try:
        np.savez(path, **arrays)
        result = rerun(directory, trials["0.01"].run_id)
    finally:
        path.write_bytes(original)
    assert result.exit_code == 2, result.output
    assert "no longer matches the data of sweep run" in result.output.replace("\n", " ")


def test_trial_runs_one_config_of_a_spec_in_process(write_spec, tmp_path, monkeypatch, threads_kept):
    monkeypatch.chdir(tmp_path)
    spec = write_spec({"search": {"space": {"learning_rate": {"loguniform": [1e-4, 1e-2]}}}, "train": {"epochs": 1}})
    refused = CliRunner().invoke(app, ["trial", str(spec)], env={"COLUMNS": "200"})
    assert refused.exit_code == 2
    assert (
        "needs one value for learning_rate (loguniform in the spec), kernel_size (choice in the spec)"
        in refused.output.replace("\n", " ")
    )
    result = CliRunner().invoke(
        app, ["trial", str(spec), "--set", "learning_rate=0.003", "--set", "kernel_size=5"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "learning_rate=0.003" in result.output and "kernel_size=5" in result.output
    assert "epoch 1: fold 0" in result.output and "fold 1" in result.output and "status: ok" in result.output
    assert not (tmp_path / "ray_results").exists()


def test_a_spec_with_paths_relative_to_itself_sweeps_and_reruns_from_anywhere(
    ray_cluster, tmp_path, monkeypatch, threads_kept
):
    """The experiment and data file are named relative to the spec's directory; the sweep runs
    from one working directory and the rerun from another."""
    import json
    import shutil

    import yaml
    from mlflow import MlflowClient

    from pipeline.records.tracking import Tracker

    project, launch, elsewhere = (tmp_path / name for name in ("project", "launch", "elsewhere"))
    for directory in (project, launch, elsewhere):
        directory.mkdir()
    source = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 400}))
    np.savez(project / "data.npz", x=source.x, y=source.y)
    shutil.copy(REPO / "experiments" / "mnist1d_cnn.py", project / "model.py")
    store = f"sqlite:///{seed_store(tmp_path / 'mlflow.db')}"
    spec = merged(
        TINY_SPEC,
        {
            "name": "relative",
            "experiment": "model.py:build",
            "dataset": "data.npz",
            "search": {"num_samples": 1, "space": {"kernel_size": 3}},
            "tracking": {"uri": store},
        },
    )
    (project / "spec.yaml").write_text(yaml.safe_dump(spec))

    monkeypatch.chdir(launch)
    swept = CliRunner().invoke(app, ["run", "../project/spec.yaml"])
    assert swept.exit_code == 0, swept.output
    _, parent, (trial, *_) = latest_sweep(store, "relative")
    assert parent.params["dataset_path"] == str(project / "data.npz")
    assert parent.params["experiment_path"] == str(project / "model.py")

    monkeypatch.chdir(elsewhere)
    again = CliRunner().invoke(app, ["rerun", trial.run_id, "--tracking-uri", store], env={"COLUMNS": "200"})
    assert again.exit_code == 0, again.output
    assert "epoch 2: fold 0" in again.output
    recorded = curve(store, trial.run_id, "split0_val_loss")
    printed = [float(value) for value in re.findall(r"fold 0 train_loss \S+ val_loss (\S+)", again.output)]
    assert printed == pytest.approx(recorded, rel=1e-3)
    # Recorded with the data file as the sweep found it, not as a path from here.
    (rerun_record,) = Tracker(store).reruns(trial.run_id)
    (trained_on,) = MlflowClient(store).get_run(rerun_record.run_id).inputs.dataset_inputs  # MLflow's own reading
    assert json.loads(trained_on.dataset.source) == {"uri": str(project / "data.npz")}

    # The experiment edited since the sweep: the rerun trains the code the sweep recorded, and says so.
    model = project / "model.py"
    model.write_text(model.read_text().replace('activation="relu"', 'activation="tanh"'))
    edited = CliRunner().invoke(
        app, ["rerun", trial.run_id, "--tracking-uri", store, "--no-track"], env={"COLUMNS": "200"}
    )
    assert edited.exit_code == 0, edited.output
    assert "model.py changed since sweep run" in " ".join(edited.output.split())
    printed = [float(value) for value in re.findall(r"fold 0 train_loss \S+ val_loss (\S+)", edited.output)]
    assert printed == pytest.approx(recorded, rel=1e-3)
