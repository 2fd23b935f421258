"""A rerun walks its trial's trajectory: the recorded plan (threads, XLA, steps per launch, fold
layout) executed again in a fresh process gives the recorded per-epoch, per-fold numbers; what a
debugging option changes is said, printed and recorded."""

from __future__ import annotations

import pytest
import yaml
from helpers import TINY_SPEC, Replace, curve, foldsweep, latest_sweep, merged, seed_store
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.records.tracking import Tag, Tracker, TrialRecord

pytestmark = pytest.mark.e2e

EPOCHS = 5  # one more than the partial rerun's --epochs 4
MNIST1D_CNN = {"conv_layers": 1, "filters": 16, "kernel_size": 3}
# A CNN with augmentation, BatchNormalization and Dropout on MNIST-1D's signals, as researchers
# write them: each signal seen as a 5x8 image, flipped and contrasted as keras.io augments images.
AUGMENTED_EXPERIMENT = """
import keras
from keras import layers


def build(hp):
    inputs = keras.Input(shape=(40, 1))
    image = layers.Reshape((5, 8, 1))(inputs)
    image = layers.RandomContrast(0.2)(layers.RandomFlip("horizontal")(image))
    x = layers.Conv1D(hp.Int("filters", 8, 16, step=8, default=8), 3, padding="same", use_bias=False)(
        layers.Reshape((40, 1))(image)
    )
    x = layers.Activation("relu")(layers.BatchNormalization()(x))
    x = layers.Dropout(hp.Float("dropout", 0.0, 0.5, default=0.2))(layers.Flatten()(x))
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(x))
"""
# One sweep per execution layout: (space, resources.cpu, experiment); the quickstart's resources
# (one CPU per trial) unless the layout needs two compute threads.
SWEEPS = {
    # Stacked: a trial that trains (SGD at 0.01) and one that goes NaN (at 50), one after the other
    # in one worker process, so that the second runs where the first ran.
    "stacked": (
        {**MNIST1D_CNN, "dropout": 0.0, "batch_size": 8, "optimizer": "sgd", "learning_rate": {"grid": [0.01, 50.0]}},
        1,
        None,
    ),
    # Side by side on two compute threads, with Dropout: each fold's draws in its own thread.
    "side_by_side": ({**MNIST1D_CNN, "dropout": 0.2, "batch_size": 8}, 2, None),
    "stacked_augmented": ({"filters": 8, "dropout": 0.2, "batch_size": 8}, 1, "augmented.py:build"),
}
EXECUTION_TAGS = (
    Tag.of("tf_threads"),
    Tag.of("fused_reason"),
    Tag.of("jit_compile"),
    Tag.of("steps_per_launch"),
    Tag.of("fused"),
    Tag.of("device"),
    Tag.of("random_draws"),
)


@pytest.fixture(scope="module")
def sweeps(ray_cluster, tmp_path_factory):
    """Each layout's sweep, recorded in one store: {layout: trial run}, the stacked sweep's NaN
    trial as "nan". One sweep per layout, because each layout is a different program the reruns
    must reproduce."""
    directory = tmp_path_factory.mktemp("fidelity")
    store = f"sqlite:///{seed_store(directory / 'mlflow.db')}"
    (directory / "augmented.py").write_text(AUGMENTED_EXPERIMENT)
    for name, (space, cpus, experiment) in SWEEPS.items():
        spec = merged(
            TINY_SPEC,
            {
                "name": name,
                "cv": {"n_splits": 3},
                "search": {"num_samples": 1, "space": Replace(space)},
                # XLA forced: each layout's XLA program is what the rerun must reproduce (a trial
                # this short would otherwise run without it, the compile weighed).
                "train": {"epochs": EPOCHS, "jit_compile": True},
                "resources": {"cpu": cpus, "max_concurrent": 1},
                "tracking": {"uri": store},
                **({"experiment": experiment} if experiment else {}),
            },
        )
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        result = CliRunner().invoke(app, ["run", str(directory / f"{name}.yaml")])
        assert result.exit_code == 0, result.output
    recorded = {name: latest_sweep(store, name).trials for name in SWEEPS}
    trials = {name: runs[0] for name, runs in recorded.items()}
    trials["stacked"], trials["nan"] = sorted(
        recorded["stacked"], key=lambda trial: float(trial.params["learning_rate"])
    )
    return directory, store, Tracker(store), trials


def the_rerun(tracker: Tracker, original: TrialRecord) -> TrialRecord:
    return tracker.reruns(original.run_id)[0]


def assert_same_trajectory(store, original, again, folds, epochs=EPOCHS, *, exactly=False):
    for k in folds:
        for key in (f"split{k}_val_loss", f"split{k}_train_loss", f"split{k}_val_accuracy"):
            recorded, rerun = curve(store, original.run_id, key), curve(store, again.run_id, key)
            assert len(rerun) == epochs, key
            assert recorded[:epochs] == (rerun if exactly else pytest.approx(rerun, rel=1e-6, abs=0)), key


@pytest.mark.parametrize(
    "layout, reason",
    [
        ("stacked", "stacked into one XLA program per step"),
        ("side_by_side", "side by side (2 compute threads)"),
        ("stacked_augmented", "stacked into one XLA program per step"),
    ],
)
def test_a_rerun_reproduces_every_epoch_of_its_trial(sweeps, layout, reason):
    """The first case sets up `sweeps` (a sweep per layout); each case is a rerun's own process."""
    directory, store, tracker, trials = sweeps
    original = trials[layout]
    assert original.tags[Tag.of("fused_reason")].endswith(reason)

    result = foldsweep("rerun", original.run_id, "--tracking-uri", store, cwd=directory)

    assert result.exit_code == 0, result.output
    assert "differs from the trial" not in result.output
    again = the_rerun(tracker, original)
    # Stacked augmentation, BatchNormalization and Dropout (foldsweep's own draws, from each fold's
    # generators): every recorded fold loss and accuracy, bit for bit.
    assert_same_trajectory(store, original, again, folds=range(3), exactly=layout == "stacked_augmented")
    if layout in ("side_by_side", "stacked_augmented"):
        assert original.tags[Tag.of("random_draws")] == "counter"
    for tag in EXECUTION_TAGS:
        assert again.tags[tag] == original.tags[tag], tag
    assert Tag.RERUN_DIFFERS not in again.tags


def test_a_nan_trial_goes_nan_again_at_the_recorded_fold_epoch_and_step(sweeps):
    directory, store, tracker, trials = sweeps
    original = trials["nan"]
    assert original.tags[Tag.STATUS] == "nan"

    result = foldsweep("rerun", original.run_id, "--tracking-uri", store, cwd=directory)

    assert result.exit_code == 0, result.output
    again = the_rerun(tracker, original)
    assert again.tags[Tag.STATUS] == "nan"
    for tag in ("nan_fold", "nan_epoch", "nan_step", "nan_last_finite_loss", "nan_grad_norm"):
        assert again.tags[Tag.of(tag)] == original.tags[Tag.of(tag)], tag
    where = (
        f"NaN in fold {original.tags[Tag.of('nan_fold')]} at epoch "
        f"{original.tags[Tag.of('nan_epoch')]}, step {original.tags[Tag.of('nan_step')]}"
    )
    assert where in " ".join(result.output.split())  # the console wraps long lines


def in_process(directory, monkeypatch, *args):
    """A rerun that compares no numbers with its trial's: in this process (``threads_kept``)."""
    monkeypatch.chdir(directory)
    return CliRunner().invoke(app, list(args))


def test_check_numerics_says_that_it_changes_the_trajectory(sweeps, monkeypatch, threads_kept):
    directory, store, tracker, trials = sweeps
    original = trials["nan"]
    result = in_process(directory, monkeypatch, "rerun", original.run_id, "--tracking-uri", store, "--check-numerics")
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "differs from the trial" in line)
    assert "jit_compile True -> False" in line and "numbers may differ from the recorded ones" in line
    assert "first non-finite value: fold " in result.output
    again = the_rerun(tracker, original)
    assert "jit_compile True -> False" in again.tags[Tag.RERUN_DIFFERS]


def test_one_fold_of_a_side_by_side_trial_is_that_fold_of_the_trial(sweeps):
    directory, store, tracker, trials = sweeps
    original = trials["side_by_side"]
    result = foldsweep("rerun", original.run_id, "--tracking-uri", store, "--fold", "1", "--epochs", "4", cwd=directory)
    assert result.exit_code == 0, result.output
    assert "differs from the trial" not in result.output
    assert_same_trajectory(store, original, the_rerun(tracker, original), folds=[1], epochs=4)


def test_one_fold_of_a_stacked_trial_names_the_difference(sweeps, monkeypatch, threads_kept):
    directory, store, tracker, trials = sweeps
    original = trials["stacked"]
    result = in_process(
        directory,
        monkeypatch,
        "rerun",
        original.run_id,
        "--tracking-uri",
        store,
        "--fold",
        "2",
        "--epochs",
        "1",
        "--set",
        "learning_rate=0.003",
    )
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "differs from the trial" in line)
    assert "layout stacked -> sequential" in line and "--set learning_rate=0.003" in line
    differs = the_rerun(tracker, original).tags[Tag.RERUN_DIFFERS]
    assert "layout stacked -> sequential" in differs and "learning_rate" in differs
