"""The loss a trial trains on (pipeline.inputs.losses): which loss a model gets, what it is given
for integer labels, and its values against Keras' own losses on the same numbers; what fit would
train differently is refused by name."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from pipeline.base.errors import ExperimentError
from pipeline.inputs.losses import outputs_problem, traced_loss, training_loss
from pipeline.inputs.spec import TrainSpec

LABELS = np.array([0, 2, 1, 2], np.int32)
PROBABILITIES = np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.2, 0.5, 0.3], [0.25, 0.25, 0.5]], np.float32)
BINARY = np.array([0, 1, 1, 0], np.int32)
SIGMOIDS = np.array([[0.2], [0.9], [0.4], [0.6]], np.float32)


def model(units: int = 3, loss=None) -> keras.Model:
    """A model of ``units`` outputs, compiled with ``loss`` when given (never built: only its
    compile is read)."""
    built = keras.Sequential([keras.layers.Dense(units)])
    if loss is not None:
        built.compile(optimizer="adam", loss=loss)
    return built


def values(tensor) -> np.ndarray:
    return keras.ops.convert_to_numpy(tensor)


def test_foldsweeps_own_loss_is_keras_sparse_categorical_cross_entropy_on_integer_labels():
    loss = training_loss(model(), train=TrainSpec(), units=3)
    assert (loss.name, loss.kind, loss.one_hot, loss.binary, loss.from_logits) == (
        "sparse_categorical_crossentropy",
        "sparse_categorical_crossentropy",
        False,
        False,
        False,
    )
    assert loss.own_accuracy and loss.reads_probabilities
    expected = keras.losses.SparseCategoricalCrossentropy(reduction=None)(LABELS, PROBABILITIES)
    np.testing.assert_allclose(values(loss.per_sample(LABELS, PROBABILITIES)), values(expected), rtol=1e-6)
    assert values(loss.correct(LABELS, PROBABILITIES)).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert loss.describe() == "sparse_categorical_crossentropy (from_logits=False)"


def test_one_output_unit_is_a_binary_classifier_given_its_labels_as_batch_by_1_floats():
    loss = training_loss(model(units=1), train=TrainSpec(), units=1)
    assert (loss.name, loss.binary, loss.one_hot) == ("binary_crossentropy", True, False)
    targets = values(loss.targets(BINARY, SIGMOIDS))
    assert targets.shape == (4, 1) and targets.dtype == np.float32 and targets[:, 0].tolist() == [0, 1, 1, 0]
    expected = keras.losses.BinaryCrossentropy(reduction=None)(BINARY[:, None].astype(np.float32), SIGMOIDS)
    np.testing.assert_allclose(values(loss.per_sample(BINARY, SIGMOIDS)), values(expected), rtol=1e-6)
    # Keras' binary accuracy: above 0.5 predicts 1 (and above 0 for logits).
    assert values(loss.correct(BINARY, SIGMOIDS)).tolist() == [1.0, 1.0, 0.0, 0.0]
    logits = training_loss(model(units=1), train=TrainSpec(from_logits=True), units=1)
    assert values(logits.correct(BINARY, np.array([[-1.0], [0.5], [-0.1], [0.2]], np.float32))).tolist() == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]


LOGITS = np.array([[-1.0], [0.7], [0.3], [-0.2]], np.float32)  # class 1 above 0.5 and between 0 and 0.5


@pytest.mark.parametrize(
    ("train", "compiled", "one_hot_labels", "labels", "outputs"),
    [
        (TrainSpec(), None, False, LABELS, PROBABILITIES),
        (TrainSpec(label_smoothing=0.1), None, False, LABELS, PROBABILITIES),  # rows, as Keras smooths them
        (TrainSpec(), None, True, LABELS, PROBABILITIES),  # the data's rows: evaluate is given rows
        (TrainSpec(from_logits=True), None, False, BINARY, LOGITS),  # counted above 0, as foldsweep's own
        (TrainSpec(), keras.losses.BinaryCrossentropy(from_logits=True), False, BINARY, LOGITS),  # Keras' 0.5
        (TrainSpec(loss="binary_focal_crossentropy"), None, False, BINARY, SIGMOIDS),
    ],
    ids=["own", "smoothed", "one-hot", "own-logits", "compiled-accuracy-on-logits", "named"],
)
def test_what_a_model_is_compiled_with_for_its_refit_scores_it_as_foldsweep_did(
    train, compiled, one_hot_labels, labels, outputs
):
    """A refit of a model that compiled no loss is saved compiled with the loss and accuracy that
    trained and scored it: Keras' evaluate of that compile (on outputs passed through) gives
    foldsweep's loss and accuracy."""
    from pipeline.inputs.losses import uncompiled_models_loss

    units = outputs.shape[1]
    scored = model(units)
    if compiled is not None:
        scored.compile(optimizer="adam", loss=compiled, metrics=["accuracy"])
    loss = training_loss(scored, train=train, units=units, one_hot_labels=one_hot_labels)
    passed = keras.Sequential([keras.Input((units,)), keras.layers.Identity()])
    passed.compile(loss=uncompiled_models_loss(loss, train), metrics=[loss.accuracy_metric()])
    given = np.eye(units, dtype=np.float32)[labels] if one_hot_labels or train.label_smoothing else labels
    evaluated = passed.evaluate(outputs, given, batch_size=len(labels), verbose=0, return_dict=True)
    assert evaluated["loss"] == pytest.approx(float(np.mean(values(loss.per_sample(labels, outputs)))), rel=1e-6)
    assert evaluated["accuracy"] == float(np.mean(values(loss.correct(labels, outputs))))


def test_label_smoothing_trains_categorical_cross_entropy_on_one_hot_rows_as_keras_smooths_them():
    loss = training_loss(model(), train=TrainSpec(label_smoothing=0.1), units=3)
    assert loss.kind == "categorical_crossentropy" and loss.one_hot
    assert loss.name == "categorical_crossentropy (label_smoothing=0.1)"
    one_hot = keras.ops.one_hot(LABELS, 3)
    expected = keras.losses.CategoricalCrossentropy(label_smoothing=0.1, reduction=None)(one_hot, PROBABILITIES)
    np.testing.assert_allclose(values(loss.per_sample(LABELS, PROBABILITIES)), values(expected), rtol=1e-6)


# Losses made when the test runs (conftest: nothing of TensorFlow while tests are collected).
@pytest.mark.parametrize(
    "make, one_hot, from_logits",
    [
        (lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True), False, True),
        (lambda: keras.losses.CategoricalCrossentropy(), True, False),
        (lambda: "categorical_crossentropy", True, False),
    ],
)
def test_the_compiled_loss_trains_with_its_own_kind_and_logits(make, one_hot, from_logits):
    compiled = make()
    loss = training_loss(model(loss=compiled), train=TrainSpec(), units=3)
    assert (loss.one_hot, loss.from_logits) == (one_hot, from_logits)
    keras_loss = keras.losses.get(compiled) if isinstance(compiled, str) else compiled
    targets = keras.ops.one_hot(LABELS, 3) if one_hot else LABELS
    expected = np.mean(values(keras_loss(targets, PROBABILITIES)))  # a function is per sample: its mean
    assert float(values(loss.batch_loss(LABELS, loss.per_sample(LABELS, PROBABILITIES)))) == pytest.approx(
        float(expected), rel=1e-6
    )


def test_a_loss_of_the_researchers_own_is_asked_whether_it_takes_integer_labels():
    def sparse_own(labels, predictions):
        return keras.losses.sparse_categorical_crossentropy(labels, predictions)

    def one_hot_own(targets, predictions):
        return keras.ops.sum(keras.ops.square(targets - predictions), axis=-1)

    assert training_loss(model(loss=sparse_own), train=TrainSpec(), units=3).one_hot is False
    own = training_loss(model(loss=one_hot_own), train=TrainSpec(), units=3)
    assert own.one_hot is True and own.from_logits is None and own.kind is None
    assert own.describe() == "one_hot_own"
    expected = np.sum((np.eye(3)[LABELS] - PROBABILITIES) ** 2, axis=-1)
    np.testing.assert_allclose(values(own.per_sample(LABELS, PROBABILITIES)), expected, rtol=1e-6)


def test_float_targets_are_regressed_on_the_loss_train_loss_names_with_targets_as_batch_by_1():
    loss = training_loss(model(units=1), train=TrainSpec(loss="huber"), units=1, regression=True)
    assert loss.regression and not loss.own_accuracy and loss.kind is None
    targets = np.array([0.5, -1.0, 2.0], np.float32)
    outputs = np.array([[0.0], [0.0], [0.0]], np.float32)
    given = values(loss.targets(keras.ops.convert_to_tensor(targets), keras.ops.convert_to_tensor(outputs)))
    assert given.shape == (3, 1) and given[:, 0].tolist() == [0.5, -1.0, 2.0]
    expected = keras.losses.Huber(reduction=None)(targets[:, None], outputs)
    per_sample = loss.per_sample(keras.ops.convert_to_tensor(targets), keras.ops.convert_to_tensor(outputs))
    np.testing.assert_allclose(values(per_sample), values(expected), rtol=1e-6)


def test_a_batch_with_ignored_positions_is_reduced_as_keras_masks_them():
    labels = np.array([[1, -1], [0, 2]], np.int32)
    outputs = np.tile(PROBABILITIES[:2, None, :], (1, 2, 1))
    compiled = keras.losses.SparseCategoricalCrossentropy(ignore_class=-1)
    loss = training_loss(model(loss=compiled), train=TrainSpec(), units=3, per_position=True)
    assert loss.per_position and loss.ignore_class == -1 and not loss.own_accuracy
    per_sample = loss.per_sample(labels, outputs)
    assert values(per_sample)[0, 1] == 0.0  # the ignored position
    batch = loss.batch_loss(labels, per_sample)
    assert float(values(batch)) == pytest.approx(float(values(compiled(labels, outputs))), rel=1e-6)


def test_the_validation_loss_sum_adds_each_batchs_mean_times_its_samples():
    loss = training_loss(model(), train=TrainSpec(), units=3)
    per_sample = values(loss.per_sample(LABELS, PROBABILITIES))
    total = float(values(loss.batches_loss_sum(LABELS, per_sample, batch_size=3)))
    assert total == pytest.approx(float(per_sample.sum()), rel=1e-6)


@pytest.mark.parametrize(
    "units, compiled, train, message",
    [
        (
            1,
            "sparse_categorical_crossentropy",
            TrainSpec(),
            "the model has one output unit and compiles sparse_categorical_crossentropy",
        ),
        (3, "binary_crossentropy", TrainSpec(), "the model has 3 output units and compiles binary_crossentropy"),
        (3, "sum", TrainSpec(), "has reduction='sum'"),
        (
            3,
            "sparse_categorical_crossentropy",
            TrainSpec(loss="huber"),
            "train.loss names huber, and the model compiles",
        ),
        (
            3,
            "sparse_categorical_crossentropy",
            TrainSpec(label_smoothing=0.1),
            "train.label_smoothing applies to foldsweep's own loss",
        ),
    ],
)
def test_what_fit_would_train_differently_is_refused_by_name(units, compiled, train, message):
    if compiled == "sum":
        compiled = keras.losses.SparseCategoricalCrossentropy(reduction="sum")
    with pytest.raises(ExperimentError, match=message):
        training_loss(model(units, loss=compiled), train=train, units=units)


@pytest.mark.parametrize(
    "train, message",
    [
        (TrainSpec(), "neither the model's compile nor the spec names a loss"),
        (TrainSpec(loss="binary_crossentropy"), "a classification loss that reads them as class labels"),
        (TrainSpec(loss="no_such_loss"), "train.loss must be a Keras loss identifier"),
    ],
)
def test_float_targets_without_a_regression_loss_are_refused(train, message):
    with pytest.raises(ExperimentError, match=message):
        training_loss(model(units=1), train=train, units=1, regression=True)


def test_outputs_read_as_probabilities_must_be_probabilities():
    categorical = training_loss(model(), train=TrainSpec(), units=3)
    assert outputs_problem(categorical, PROBABILITIES) is None
    problem = outputs_problem(categorical, np.array([[2.0, -1.0, 0.5]], np.float32))
    assert problem == "its outputs range from -1 to 2 and its rows sum to 1.5..1.5, not probabilities that sum to 1"
    binary = training_loss(model(units=1), train=TrainSpec(), units=1)
    assert outputs_problem(binary, SIGMOIDS) is None
    assert outputs_problem(binary, np.array([[1.5], [0.2]], np.float32)) == (
        "its outputs range from 0.2 to 1.5, not probabilities between 0 and 1"
    )
    logits = training_loss(model(), train=TrainSpec(from_logits=True), units=3)
    assert outputs_problem(logits, np.array([[2.0, -1.0, 0.5]], np.float32)) is None


def test_a_loss_that_cannot_be_traced_as_fits_step_traces_it_says_how_to_write_it():
    def branches(labels, predictions):
        if keras.ops.sum(predictions) > 0:  # a Python `if` on a tensor: not in a graph without AutoGraph
            return keras.losses.sparse_categorical_crossentropy(labels, predictions)
        return keras.ops.zeros_like(predictions[:, 0])

    assert traced_loss(training_loss(model(), train=TrainSpec(), units=3), PROBABILITIES).problem is None
    problem = traced_loss(training_loss(model(loss=branches), train=TrainSpec(), units=3), PROBABILITIES).problem
    assert problem is not None and problem[1] == "write the condition with tf.where or tf.cond"
    assert "Using a symbolic `tf.Tensor` as a Python `bool` is not allowed" in problem[0]


def test_only_a_loss_of_keras_own_is_known_to_see_each_sample_alone():
    """A padded last batch (``pipeline.contract.plan.padding_blocker``) needs a loss that computes
    each sample from that sample alone: Keras' own, bound to options or not; a researcher's own
    function, which may look at the whole batch, is not taken for one."""
    import functools

    import keras

    from pipeline.inputs.losses import TrainingLoss

    def batch_centred(y_true, y_pred):
        return keras.ops.square(y_pred[:, 0] - keras.ops.mean(y_pred[:, 0]))

    assert TrainingLoss(functools.partial(keras.losses.sparse_categorical_crossentropy, from_logits=True)).keras_own
    assert TrainingLoss(keras.losses.MeanSquaredError(), regression=True).keras_own
    assert not TrainingLoss(batch_centred, regression=True).keras_own


def test_a_loss_that_reduces_over_the_batch_gives_one_value_for_it_not_one_per_sample():
    # Keras' Dice reduces over every axis, the batch's too, unless given one.
    per_sample = traced_loss(
        training_loss(model(loss=keras.losses.Dice(axis=(1,))), train=TrainSpec(), units=3), PROBABILITIES
    )
    per_batch = traced_loss(training_loss(model(loss=keras.losses.Dice()), train=TrainSpec(), units=3), PROBABILITIES)
    assert per_sample.value_shape == (len(PROBABILITIES),) and not per_sample.per_batch(len(PROBABILITIES))
    assert per_batch.value_shape == () and per_batch.per_batch(len(PROBABILITIES))
