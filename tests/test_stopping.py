"""A trial's own early stopping: Keras' EarlyStopping rule on the mean CV curve, the spec key, and
a HyperModel.fit's EarlyStopping translated (or refused by name)."""

from __future__ import annotations

import types

import numpy as np
import pytest
from helpers import DELETE
from typer.testing import CliRunner

from pipeline.base.errors import ExperimentError, SpecError
from pipeline.cli import app
from pipeline.engine.stopping import Patience
from pipeline.inputs.spec import EarlyStoppingSpec, load_spec

CURVES = {
    "falls then rises": [1.0, 0.8, 0.7, 0.72, 0.75, 0.71, 0.9, 1.1, 1.2],
    "plateau within min_delta": [1.0, 0.9, 0.899, 0.898, 0.897, 0.896, 0.895],
    "noisy": [0.9, 0.7, 0.75, 0.69, 0.8, 0.85, 0.68, 0.9, 0.95, 0.99, 1.0],
}
RULES = [
    EarlyStoppingSpec(patience=2, monitor="loss"),
    EarlyStoppingSpec(patience=3, monitor="loss", min_delta=0.005),
    EarlyStoppingSpec(patience=1, monitor="loss", start_from_epoch=3),
    EarlyStoppingSpec(patience=2, monitor="loss", baseline=0.7),
    EarlyStoppingSpec(patience=2, monitor="accuracy"),
]


def keras_stops_at(rule: EarlyStoppingSpec, curve: list[float]) -> int | None:
    """The 1-based epoch at which Keras' own EarlyStopping ends fit() on this validation curve."""
    import keras

    callback = keras.callbacks.EarlyStopping(
        monitor=f"val_{rule.monitor}",
        patience=rule.patience,
        min_delta=rule.min_delta,
        baseline=rule.baseline,
        start_from_epoch=rule.start_from_epoch,
        mode="min" if rule.monitor == "loss" else "max",
    )
    model = types.SimpleNamespace(stop_training=False)
    callback.set_model(model)
    callback.on_train_begin()
    for epoch, value in enumerate(curve):
        callback.on_epoch_end(epoch, {f"val_{rule.monitor}": value})
        if model.stop_training:
            return epoch + 1
    return None


def foldsweep_stops_at(rule: EarlyStoppingSpec, curve: list[float]) -> int | None:
    patience = Patience(rule)
    for epoch, value in enumerate(curve, start=1):
        # One live fold: its mean is the curve's value exactly (a float mean of equal values need not be).
        if patience.observe(epoch, [value]):
            return epoch
    return None


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.describe())
@pytest.mark.parametrize("name", sorted(CURVES))
def test_the_rule_stops_where_keras_early_stopping_stops(rule, name):
    curve = CURVES[name] if rule.monitor == "loss" else [1 - value for value in CURVES[name]]
    assert foldsweep_stops_at(rule, curve) == keras_stops_at(rule, curve)


def test_the_rule_stops_patience_epochs_after_the_best_and_a_nan_fold_is_no_worse_epoch():
    rule = EarlyStoppingSpec(patience=3, monitor="loss")
    assert foldsweep_stops_at(rule, CURVES["falls then rises"]) == 3 + 3
    patience = Patience(rule)
    assert not patience.observe(1, [1.0, 1.0])
    assert not patience.observe(2, [0.5, 0.5])
    for epoch in (3, 4, 5):  # a fold went NaN: only the live folds are watched, and they improve
        assert not patience.observe(epoch, [0.5 - 0.01 * epoch, float("nan")])
    state = patience.state()
    again = Patience(rule)
    again.restore(state)
    assert again.state() == state and again.wait == 0


@pytest.mark.parametrize(
    "section, message",
    [
        ({"early_stopping": {}}, "train.early_stopping.patience is required"),
        ({"early_stopping": {"patience": 0}}, "train.early_stopping.patience must be an integer >= 1, got 0"),
        # Any validation metric may be watched (val_loss is read as loss); one of unknown direction needs its mode.
        (
            {"early_stopping": {"patience": 2, "monitor": "mcc"}},
            "train.early_stopping.mode is required for monitor mcc",
        ),
        (
            {"early_stopping": {"patience": 2, "monitor": "val loss"}},
            "train.early_stopping.monitor must be a metric's name",
        ),
        ({"early_stopping": {"patience": 2, "min_delta": -1}}, "train.early_stopping.min_delta must be a number >= 0"),
        ({"early_stopping": {"patience": 2, "baseline": "high"}}, "train.early_stopping.baseline must be a number"),
        ({"early_stopping": {"patience": 2, "wait": 1}}, "unknown key 'train.early_stopping.wait'"),
    ],
)
def test_early_stopping_rules(write_spec, section, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_spec(write_spec({"train": section}))


def test_the_monitor_defaults_to_the_sweeps_metric(write_spec):
    spec = load_spec(write_spec({"train": {"metric": "loss", "mode": DELETE, "early_stopping": {"patience": 4}}}))
    assert spec.train.early_stopping == EarlyStoppingSpec(patience=4, monitor="loss")
    assert spec.train.early_stopping.objective.mode == "min"


FIT_WITH = """
import keras
import keras_tuner


class Model(keras_tuner.HyperModel):
    def build(self, hp):
        return keras.Sequential([keras.Input((40, 1)), keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])

    def fit(self, hp, model, *args, **kwargs):
        kwargs["callbacks"] = kwargs.get("callbacks", []) + [{callback}]
        return model.fit(*args, batch_size=hp.Choice("batch_size", [16, 32]), **kwargs)
"""


def test_a_hypermodels_early_stopping_becomes_the_rule_and_validate_says_so(write_spec, write_experiment):
    callback = "keras.callbacks.EarlyStopping(monitor='val_loss', patience=2, restore_best_weights=True)"
    experiment = write_experiment(FIT_WITH.format(callback=callback))
    result = CliRunner().invoke(
        app, ["validate", str(write_spec({"experiment": f"{experiment}:Model", "search": {"space": None}}))]
    )
    output = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert (
        "EarlyStopping(monitor='val_loss', patience=2) in " in output
        and "fit() becomes train.early_stopping: {patience: 2, monitor: loss}, on the trial's mean CV curve" in output
    )
    # The spec scores accuracy (TINY_SPEC's metric): its best epoch, as KerasTuner scores a trial.
    assert (
        "restore_best_weights=True is what train.select: best_epoch does: each trial is scored at its best epoch of "
        "mean_val_accuracy, as KerasTuner scores a trial by its objective, and the refit trains that many epochs, "
        "not at the epoch of the best val_loss that fit would restore"
    ) in output


@pytest.mark.parametrize(
    "callback, message",
    [
        (
            "keras.callbacks.EarlyStopping(monitor='loss', patience=2)",
            "(1) EarlyStopping(monitor='loss'): foldsweep stops a trial on its mean CV validation curve",
        ),
        ("keras.callbacks.EarlyStopping(monitor='val_loss', mode='max')", "mode='min' or 'auto'"),
        (
            "keras.callbacks.ModelCheckpoint('best.keras')",
            "passes model.fit 1 thing foldsweep cannot honour: (1) the "
            "callback ModelCheckpoint, which foldsweep cannot honour: foldsweep "
            "keeps its own per-epoch checkpoints",
        ),
        ("keras.callbacks.ReduceLROnPlateau()", "the callback ReduceLROnPlateau"),
    ],
)
def test_callbacks_foldsweep_cannot_honour_are_refused_by_name(write_experiment, callback, message):
    from pathlib import Path

    from pipeline.inputs.hypermodel import load_experiment

    path = write_experiment(FIT_WITH.format(callback=callback))
    with pytest.raises(ExperimentError) as refused:
        load_experiment(Path(path), "Model")
    assert message in str(refused.value)


def test_callbacks_added_to_kerastuners_own_list_in_place_are_read_as_those_added_to_a_copy(write_experiment):
    """keras.io's examples extend the callbacks KerasTuner passes: the very list foldsweep gave."""
    from pathlib import Path

    from pipeline.inputs.hypermodel import load_experiment

    in_place = 'kwargs.setdefault("callbacks", []).extend([{callback}])'
    copied = 'kwargs["callbacks"] = kwargs.get("callbacks", []) + [{callback}]'
    refused = write_experiment(
        FIT_WITH.replace(copied, in_place).format(callback="keras.callbacks.ReduceLROnPlateau()"), "refused.py"
    )
    with pytest.raises(ExperimentError, match="the callback ReduceLROnPlateau"):
        load_experiment(Path(refused), "Model")
    stopping = "keras.callbacks.EarlyStopping(monitor='val_loss', patience=3)"
    translated = write_experiment(FIT_WITH.replace(copied, in_place).format(callback=stopping), "translated.py")
    assert load_experiment(Path(translated), "Model").fit_early_stopping == EarlyStoppingSpec(
        patience=3, monitor="loss"
    )


def test_an_early_stopped_trial_counts_as_done_at_its_stopped_epoch():
    from pipeline.inputs.spec import Objective
    from pipeline.records.progress import SweepProgress

    progress = SweepProgress(Objective(), trials_planned=2, epochs_per_trial=40)
    progress.result("a", "", {"epoch": 7, "epochs_planned": 40, "mean_val_accuracy": 0.8, "stopped_epoch": 7})
    progress.ended("a", "", "ok")
    progress.result("b", "", {"epoch": 7, "epochs_planned": 40, "mean_val_accuracy": 0.7})
    assert progress.counts()["done"] == 1
    # a is whole at its 7 epochs (47 in all, not 80); b's 7 came in the 1 s since a ended, 33 to go.
    since, epochs_then = progress.rate_start
    progress.rate_start = (since - 1.0, epochs_then)
    from pipeline.records.progress import eta_seconds

    assert progress.eta() == pytest.approx(
        eta_seconds(epochs_done=14 - 7, epochs_total=47 - 7, elapsed_s=1.0), rel=1e-2
    )
    assert np.isfinite(progress.eta())


KERAS_IO_FIT = """
import keras
import keras_tuner


class Model(keras_tuner.HyperModel):
    def build(self, hp):
        return keras.Sequential([keras.Input((40, 1)), keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])

    def fit(self, hp, model, *args, **kwargs):
        # keras.io's "Timeseries classification from scratch", ported as its author would.
        kwargs["callbacks"] = kwargs.get("callbacks", []) + [
            keras.callbacks.ModelCheckpoint("best_model.keras", save_best_only=True, monitor="val_loss"),
            keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=20, min_lr=0.0001),
            keras.callbacks.EarlyStopping(monitor="val_loss", patience=50, verbose=1),
        ]
        return model.fit(*args, batch_size=32, epochs=500, validation_split=0.2, verbose=1, **kwargs)
"""


def test_a_fit_foldsweep_cannot_honour_lists_every_problem_in_one_message(write_experiment):
    from pathlib import Path

    from pipeline.inputs.hypermodel import load_experiment

    with pytest.raises(ExperimentError) as refused:
        load_experiment(Path(write_experiment(KERAS_IO_FIT)), "Model")
    message = str(refused.value)
    assert (
        "its HyperModel.fit passes model.fit 3 things foldsweep cannot honour: (1) the callback ModelCheckpoint, "
        "which foldsweep cannot honour: foldsweep keeps its own per-epoch checkpoints" in message
    )
    assert (
        "; (2) the callback ReduceLROnPlateau, which foldsweep cannot honour: it would change the learning rate"
        in message
    )
    assert (
        "; (3) validation_split=...: each fold's held-out part is its validation data (cv in the spec): drop it."
        in message
    )
    assert "EarlyStopping" not in message.split(". foldsweep trains")[0]  # the one it translates is no problem


def test_a_fit_that_passes_callbacks_twice_is_told_in_its_own_words(write_experiment):
    from pathlib import Path

    from pipeline.inputs.hypermodel import load_experiment

    twice = KERAS_IO_FIT.replace('kwargs["callbacks"] = kwargs.get("callbacks", []) + [', "callbacks = [").replace(
        "validation_split=0.2, verbose=1, **kwargs)", "callbacks=callbacks, **kwargs)"
    )
    with pytest.raises(ExperimentError) as refused:
        load_experiment(Path(write_experiment(twice)), "Model")
    message = str(refused.value)
    assert (
        "TypeError: model.fit() got multiple values for keyword argument 'callbacks' (KerasTuner passes "
        "callbacks in **kwargs too: add yours to them, kwargs['callbacks'] = kwargs.get('callbacks', []) + [...])"
        in message
    )
    assert "_RecordingFit" not in message
