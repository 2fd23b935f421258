"""The loss a trial trains on and how its outputs are scored, as Keras' ``fit`` reads them.

Labels are integer classes, one per sample. A model with one output unit is a binary
classifier: its labels are 0 and 1, they reach the loss as ``[batch, 1]`` floats (what ``fit``
hands a loss for ``y`` of shape ``[batch]``), and its accuracy is Keras' binary accuracy (an
output above 0.5, or above 0 for logits, predicts 1). A model with more units is scored by the
arg max. The loss is the one the hypermodel compiled, or foldsweep's: sparse categorical
cross-entropy, binary cross-entropy for one unit, reading logits where ``train.from_logits``
says so.

Float targets are regressed: the loss is the one the model compiles or ``train.loss`` names
(mean squared error, mean absolute error, Huber, log-cosh, any Keras loss), given the targets as
floats, a target of shape ``[batch]`` as ``[batch, 1]`` against one output (what Keras' losses do
with it); no accuracy is scored. A classification loss on float targets, and float targets with
no loss named, are refused.

What ``fit`` would train differently, or not at all, is refused here, by name: a categorical
loss on one unit (always 0), a binary loss on several units (one yes/no per unit, not a class),
a reduction other than the batch mean.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import keras
import numpy as np

from pipeline.base.errors import ExperimentError
from pipeline.inputs.scoring import compiles_keras_accuracy
from pipeline.inputs.spec import TrainSpec

BINARY_LOSSES = ("binary_crossentropy", "binary_focal_crossentropy")
CATEGORICAL_LOSSES = ("sparse_categorical_crossentropy", "categorical_crossentropy", "categorical_focal_crossentropy")
# Keras' own classification losses, as classes and as functions: what a compile names, whatever
# name the researcher gave the object.
_KERAS_LOSS_KINDS: dict[Any, str] = {
    keras.losses.BinaryCrossentropy: "binary_crossentropy",
    keras.losses.binary_crossentropy: "binary_crossentropy",
    keras.losses.BinaryFocalCrossentropy: "binary_focal_crossentropy",
    keras.losses.binary_focal_crossentropy: "binary_focal_crossentropy",
    keras.losses.SparseCategoricalCrossentropy: "sparse_categorical_crossentropy",
    keras.losses.sparse_categorical_crossentropy: "sparse_categorical_crossentropy",
    keras.losses.CategoricalCrossentropy: "categorical_crossentropy",
    keras.losses.categorical_crossentropy: "categorical_crossentropy",
    keras.losses.CategoricalFocalCrossentropy: "categorical_focal_crossentropy",
    keras.losses.categorical_focal_crossentropy: "categorical_focal_crossentropy",
}
# The Loss class of each kind: what a message tells the researcher to compile.
LOSS_CLASSES: dict[str, type] = {kind: loss for loss, kind in _KERAS_LOSS_KINDS.items() if isinstance(loss, type)}
# Reductions that make the batch's loss the mean over its samples, which is what the engine
# trains on; "sum" would scale every gradient by the batch size.
MEAN_REDUCTIONS = (None, "auto", "sum_over_batch_size", "mean")
# How far a row of probabilities may sum from 1 (float32 softmax rows sum within 1e-6).
PROBABILITY_SUM_TOLERANCE = 1e-3


@dataclass(frozen=True)
class TrainingLoss:
    """The per-sample loss a trial trains and validates on, from integer labels, and how a
    prediction is scored. ``from_logits`` is None for a loss of the researcher's own, which
    does not say."""

    fn: Callable[[Any, Any], Any]
    one_hot: bool = False
    name: str = "sparse_categorical_crossentropy"
    binary: bool = False
    from_logits: bool | None = False
    kind: str | None = "sparse_categorical_crossentropy"  # the Keras loss it is, if one of CATEGORICAL/BINARY_LOSSES
    regression: bool = False  # float targets, no accuracy
    # Labels per position ([batch, L] against outputs [batch, L, classes]): accuracy is only
    # what the model compiles, and a label equal to ``ignore_class`` counts in no loss.
    per_position: bool = False
    ignore_class: int | None = None
    # The data's labels were one-hot rows (``Dataset.one_hot``): the metrics get rows, as fit gives them.
    labels_one_hot: bool = False
    # A one-unit head read as logits whose model compiles Keras' "accuracy": fit scores it with
    # BinaryAccuracy's threshold, 0.5, whatever the outputs are, so an output above 0.5 counts as
    # class 1 (foldsweep's own accuracy of a logit counts one above 0).
    logits_thresholded_at_half: bool = False

    @property
    def keras_own(self) -> bool:
        """Whether the loss is one of Keras' (a function or a Loss of its modules, options bound):
        one that computes each sample's loss from that sample alone. A researcher's own may look
        at the whole batch."""
        target = self.fn.func if isinstance(self.fn, functools.partial) else self.fn
        module = getattr(target, "__module__", None) or type(target).__module__
        return module.split(".")[0] == "keras"

    @property
    def own_accuracy(self) -> bool:
        """Whether foldsweep scores the accuracy itself (one class label per sample)."""
        return not self.regression and not self.per_position

    def batch_loss(self, labels: Any, per_sample: Any) -> Any:
        """The batch's loss as Keras reduces it (sum_over_batch_size): the mean over every sample
        and position, or with ``ignore_class`` the sum over the positions not ignored divided by
        their count (Keras' mask reduction)."""
        import tensorflow as tf

        if self.ignore_class is None:
            return tf.reduce_mean(per_sample)
        valid = tf.cast(tf.not_equal(labels, self.ignore_class), per_sample.dtype)
        return tf.reduce_sum(per_sample) / (tf.reduce_sum(valid) + keras.backend.epsilon())

    def padded_batch_loss(self, labels: Any, per_sample: Any, own: Any) -> Any:
        """``batch_loss`` of the samples ``own`` marks ([batch] booleans; the rest pad the batch):
        the padding adds nothing to the loss, its gradient or the counts it is divided by."""
        import tensorflow as tf

        rows = tf.shape(per_sample)[0]
        kept = tf.broadcast_to(tf.reshape(own, [rows] + [1] * (per_sample.shape.rank - 1)), tf.shape(per_sample))
        total = tf.reduce_sum(tf.where(kept, per_sample, tf.zeros_like(per_sample)))
        if self.ignore_class is None:
            return total / tf.cast(tf.math.count_nonzero(kept), per_sample.dtype)
        valid = tf.cast(tf.not_equal(labels, self.ignore_class) & kept, per_sample.dtype)
        return total / (tf.reduce_sum(valid) + keras.backend.epsilon())

    def batches_loss_sum(self, labels: Any, per_sample: Any, batch_size: int) -> Any:
        """The validation loss of ``labels``' samples as Keras' evaluate adds it up in batches of
        ``batch_size``: each batch's ``batch_loss`` times its number of samples, summed."""
        import tensorflow as tf

        rows = tf.shape(per_sample)[0]
        flat = tf.reshape(per_sample, [rows, -1])
        if self.ignore_class is None:
            return tf.reduce_sum(tf.reduce_mean(flat, axis=1))
        valid = tf.cast(tf.not_equal(tf.reshape(labels, [rows, -1]), self.ignore_class), flat.dtype)
        batch = tf.range(rows) // batch_size
        sums = tf.math.segment_sum(tf.reduce_sum(flat, axis=1), batch)
        counts = tf.math.segment_sum(tf.reduce_sum(valid, axis=1), batch)
        samples = tf.math.segment_sum(tf.ones([rows], flat.dtype), batch)
        return tf.reduce_sum(sums / (counts + keras.backend.epsilon()) * samples)

    def targets(self, labels: Any, predictions: Any) -> Any:
        """What the loss is given for integer ``labels``: ``[batch, 1]`` floats for a binary head,
        one-hot rows for a loss that expects them, else the labels."""
        import tensorflow as tf

        if self.regression:
            targets = tf.cast(labels, predictions.dtype)
            return targets[..., tf.newaxis] if targets.shape.rank == predictions.shape.rank - 1 else targets
        if self.binary:
            return tf.cast(labels, predictions.dtype)[..., tf.newaxis]
        if self.one_hot:
            return _rows(labels, predictions)
        return labels

    @property
    def metrics_take_rows(self) -> bool:
        """Whether the model's metrics are given one-hot rows: where the data's labels were rows, and
        where the loss takes rows of integer labels, as fit gives both to_categorical(y) (it refuses
        the labels themselves under such a loss)."""
        return self.labels_one_hot or self.one_hot

    def metric_targets(self, labels: Any, predictions: Any) -> Any:
        """What the model's metrics are given for integer ``labels`` (``metrics_take_rows``)."""
        return _rows(labels, predictions) if self.metrics_take_rows else labels

    def per_sample(self, labels: Any, predictions: Any) -> Any:
        return self.fn(self.targets(labels, predictions), predictions)

    def correct(self, labels: Any, predictions: Any) -> Any:
        """1.0 where the prediction is right, else 0.0 (Keras' binary accuracy for one unit)."""
        import tensorflow as tf

        if self.binary:
            predicted = tf.cast(predictions[:, 0] > self.binary_threshold, labels.dtype)
        else:
            predicted = tf.argmax(predictions, -1, output_type=labels.dtype)
        return tf.cast(predicted == labels, tf.float32)

    @property
    def reads_probabilities(self) -> bool:
        """A Keras cross-entropy told that the outputs are probabilities."""
        return self.kind is not None and self.from_logits is False

    def describe(self) -> str:
        logits = "" if self.from_logits is None else f" (from_logits={self.from_logits})"
        return f"{self.name}{logits}"

    @property
    def binary_threshold(self) -> float:
        """Above what a one-unit head's output counts as class 1: 0.5 (Keras' BinaryAccuracy), or 0
        for a logit, unless the model compiles Keras' "accuracy" (``logits_thresholded_at_half``)."""
        return 0.0 if self.from_logits and not self.logits_thresholded_at_half else 0.5

    def accuracy_metric(self) -> Any:
        """What ``compile(metrics=...)`` is given for the accuracy foldsweep scores (``correct``):
        Keras' "accuracy", or BinaryAccuracy at a one-unit head's other threshold."""
        if self.binary and self.binary_threshold != 0.5:
            return keras.metrics.BinaryAccuracy(name="accuracy", threshold=self.binary_threshold)
        return "accuracy"


def uncompiled_models_loss(loss: TrainingLoss, train: TrainSpec) -> Any:
    """What ``compile(loss=...)`` is given for the loss that trained a model whose build compiled
    none: ``train.loss`` as named, else foldsweep's own cross-entropy as a Keras Loss, on the rows
    where the data's labels were one-hot rows (what ``evaluate`` is then given)."""
    if train.loss is not None:
        return train.loss
    assert loss.kind is not None  # foldsweep's own is a Keras cross-entropy
    kind = "categorical_crossentropy" if loss.labels_one_hot and not loss.binary else loss.kind
    smoothing = {"label_smoothing": train.label_smoothing} if train.label_smoothing else {}
    return LOSS_CLASSES[kind](from_logits=bool(loss.from_logits), **smoothing)


def _rows(labels: Any, predictions: Any) -> Any:
    """Integer labels as one-hot rows over the predictions' classes, in their dtype."""
    import tensorflow as tf

    return tf.one_hot(labels, tf.shape(predictions)[-1], dtype=predictions.dtype)


def training_loss(
    model: keras.Model,
    *,
    train: TrainSpec,
    units: int,
    regression: bool = False,
    per_position: bool = False,
    one_hot_labels: bool = False,
) -> TrainingLoss:
    """The loss a compiled model asks for, else the one ``train.loss`` names, else foldsweep's
    (``train.from_logits`` applies to foldsweep's own); ``units`` is the model's number of
    outputs, ``regression`` whether the targets are floats, ``one_hot_labels`` whether the data's
    labels were one-hot rows (held as class indices: ``pipeline.inputs.datasets.as_class_indices``).

    Raises:
        ExperimentError: the compiled loss cannot train a classifier of ``units`` outputs on
            integer labels as ``fit`` would, or regress float targets (see the module's docstring).
    """
    compiled = getattr(model, "loss", None)
    binary = units == 1
    if compiled is not None and train.loss is not None:
        raise ExperimentError(
            f"train.loss names {train.loss}, and the model compiles its own loss ({compiled!r}): one loss trains "
            "a model, drop train.loss or the compile's loss"
        )
    if compiled is None and train.loss is not None:
        compiled = train.loss
    if compiled is None and regression:
        raise ExperimentError(
            "the targets are floats (regression) and neither the model's compile nor the spec names a loss: "
            "set train.loss (e.g. mean_squared_error, mean_absolute_error, huber, log_cosh) or compile one; "
            "foldsweep's own loss is a classifier's cross-entropy"
        )
    if regression:
        return _regression_loss(compiled)
    loss = _classification_loss(model, compiled, train, units, binary)
    if loss.binary and loss.from_logits and compiles_keras_accuracy(model):
        loss = replace(loss, logits_thresholded_at_half=True)
    if one_hot_labels:
        _refuse_one_hot_misread(loss, compiled)
        loss = replace(loss, labels_one_hot=True)
    return replace(loss, per_position=True, ignore_class=_ignore_class(compiled)) if per_position else loss


def _refuse_one_hot_misread(loss: TrainingLoss, compiled: Any) -> None:
    """One-hot rows train a loss that takes rows (or foldsweep's own, the same cross-entropy on
    their classes); fit refuses them against one output unit or a sparse loss, and so does foldsweep."""
    if loss.binary:
        raise ExperimentError(
            "the labels are one-hot rows, and the model ends in one output unit (a binary classifier), which fit "
            "cannot train on rows: store the class of each row (y.argmax(axis=1)), or end the model in "
            "Dense(2, activation='softmax') with categorical_crossentropy"
        )
    if compiled is not None and not loss.one_hot:
        raise ExperimentError(
            f"the labels are one-hot rows, and the loss {loss.name} takes class indices: train categorical_crossentropy "
            "on one-hot rows, or store the class of each row (y.argmax(axis=1))"
        )


def _ignore_class(compiled: Any) -> int | None:
    """A SparseCategoricalCrossentropy's ``ignore_class`` (padded positions), if it sets one."""
    if isinstance(compiled, keras.losses.Loss):
        value = compiled.get_config().get("ignore_class")
        return None if value is None else int(value)
    return None


def _classification_loss(model: keras.Model, compiled: Any, train: TrainSpec, units: int, binary: bool) -> TrainingLoss:
    if compiled is None:
        return _own_loss(train, binary=binary)
    if train.label_smoothing:
        raise ExperimentError(
            f"train.label_smoothing applies to foldsweep's own loss, and the model compiles its own ({compiled!r}): "
            "set label_smoothing on the compiled loss (keras.losses.CategoricalCrossentropy(label_smoothing=...)) "
            f"or drop the compile's loss, got train.label_smoothing={train.label_smoothing:g}"
        )
    loss = keras.losses.get(compiled) if isinstance(compiled, str) else compiled
    # A Loss object's call() gives per-sample values, unreduced; a loss function does too.
    fn = loss.call if isinstance(loss, keras.losses.Loss) else loss
    name = _loss_name(loss)
    kind = _KERAS_LOSS_KINDS.get(type(loss) if isinstance(loss, keras.losses.Loss) else loss)
    _refuse_unfit(loss, kind, name, units)
    return TrainingLoss(
        fn,
        one_hot=not binary and _expects_one_hot(loss, fn, name, kind),
        name=name,
        binary=binary,
        from_logits=_from_logits(loss, kind),
        kind=kind,
    )


def _loss_name(loss: Any) -> str:
    """A Loss object's name, a loss function's, or its class's."""
    return str(getattr(loss, "name", None) or getattr(loss, "__name__", type(loss).__name__))


def _regression_loss(compiled: Any) -> TrainingLoss:
    try:
        loss = keras.losses.get(compiled) if isinstance(compiled, str) else compiled
    except (ValueError, TypeError):
        raise ExperimentError(
            f"train.loss must be a Keras loss identifier (e.g. mean_squared_error, huber), got {compiled!r}"
        ) from None
    fn = loss.call if isinstance(loss, keras.losses.Loss) else loss
    name = _loss_name(loss)
    kind = _KERAS_LOSS_KINDS.get(type(loss) if isinstance(loss, keras.losses.Loss) else loss)
    if kind is not None:
        raise ExperimentError(
            f"the targets are floats (regression), and the loss is {name}, a classification loss that reads them as "
            "class labels or probabilities: compile (or set train.loss to) a regression loss such as "
            "mean_squared_error, mean_absolute_error, huber or log_cosh, or store class labels as integers"
        )
    reduction = getattr(loss, "reduction", None)
    if reduction not in MEAN_REDUCTIONS:
        raise ExperimentError(
            f"the loss {name} has reduction={reduction!r}; foldsweep trains on the batch mean, as Keras' default "
            "'sum_over_batch_size' does: drop the reduction argument"
        )
    return TrainingLoss(fn, name=name, from_logits=None, kind=None, regression=True)


def _own_loss(train: TrainSpec, *, binary: bool) -> TrainingLoss:
    """Binary or sparse categorical cross-entropy; with label smoothing, which Keras' sparse loss
    lacks, categorical cross-entropy on one-hot targets (what smoothing spreads)."""
    smoothing = train.label_smoothing
    if binary:
        kind, fn = "binary_crossentropy", keras.losses.binary_crossentropy
    elif smoothing:
        kind, fn = "categorical_crossentropy", keras.losses.categorical_crossentropy
    else:
        kind, fn = "sparse_categorical_crossentropy", keras.losses.sparse_categorical_crossentropy
    options = {"from_logits": train.from_logits, **({"label_smoothing": smoothing} if smoothing else {})}
    return TrainingLoss(
        functools.partial(fn, **options),
        one_hot=kind == "categorical_crossentropy",
        name=kind if not smoothing else f"{kind} (label_smoothing={smoothing:g})",
        binary=binary,
        from_logits=train.from_logits,
        kind=kind,
    )


def _refuse_unfit(loss: Any, kind: str | None, name: str, units: int) -> None:
    if units == 1 and kind in CATEGORICAL_LOSSES:
        raise ExperimentError(
            f"the model has one output unit and compiles {name}, a loss over classes: with one unit it is the same "
            "whatever the weights, so nothing would train. A binary classifier compiles binary_crossentropy "
            "(keras.losses.BinaryCrossentropy) on Dense(1, activation='sigmoid'), or ends in Dense(2, "
            "activation='softmax') for this loss"
        )
    if units > 1 and kind in BINARY_LOSSES:
        raise ExperimentError(
            f"the model has {units} output units and compiles {name}, which scores every unit as a yes/no label of "
            "its own (multi-label); foldsweep trains one integer class per sample: compile "
            f"sparse_categorical_crossentropy for {units} classes, or end in one unit for a binary classifier"
        )
    reduction = getattr(loss, "reduction", None)
    if reduction not in MEAN_REDUCTIONS:
        raise ExperimentError(
            f"the compiled loss {name} has reduction={reduction!r}; foldsweep trains on the batch mean, as "
            "Keras' default 'sum_over_batch_size' does: drop the reduction argument (scale the learning rate instead)"
        )


def _from_logits(loss: Any, kind: str | None) -> bool | None:
    if kind is None:
        return None
    if isinstance(loss, keras.losses.Loss):
        return bool(loss.get_config().get("from_logits", False))
    return False  # Keras' loss functions default to probabilities


def _expects_one_hot(loss: Any, fn: Callable[[Any, Any], Any], name: str, kind: str | None) -> bool:
    """Keras' sparse losses take integer labels and its other classification losses one-hot
    targets; a loss of the researcher's own is asked: integer labels first."""
    if kind is not None:
        return not kind.startswith("sparse")
    if "sparse" in name.lower():
        return False
    if (getattr(loss, "__module__", "") or getattr(type(loss), "__module__", "")).startswith("keras"):
        return True
    try:
        values = fn(np.array([0, 1], np.int32), np.full((2, 3), 1 / 3, np.float32))
        return tuple(values.shape) != (2,)
    except Exception:
        return True


def outputs_problem(loss: TrainingLoss, outputs: np.ndarray) -> str | None:
    """Why ``outputs`` (the model's, on real samples) cannot be what ``loss`` reads them as:
    probabilities under a cross-entropy that says they are (None when they can)."""
    if not loss.reads_probabilities or outputs.size == 0:
        return None
    outputs = outputs.reshape(-1, outputs.shape[-1])  # a row of class probabilities per sample (and position)
    low, high = float(np.min(outputs)), float(np.max(outputs))
    if loss.binary:
        if low < 0.0 or high > 1.0:
            return f"its outputs range from {low:.3g} to {high:.3g}, not probabilities between 0 and 1"
        return None
    sums = outputs.sum(axis=1)
    if low < 0.0 or np.abs(sums - 1.0).max() > PROBABILITY_SUM_TOLERANCE:
        return (
            f"its outputs range from {low:.3g} to {high:.3g} and its rows sum to {sums.min():.3g}..{sums.max():.3g}, "
            "not probabilities that sum to 1"
        )
    return None


@dataclass(frozen=True)
class TracedLoss:
    """A loss traced into a graph as Keras' fit traces its step (without AutoGraph, so a Python
    ``if`` on a tensor or a tensor's ``.numpy()`` is an error there), on a batch of the model's
    outputs: why it cannot be and how to write it instead (``problem``), else the shape of what it
    gives for the batch (``value_shape``)."""

    problem: tuple[str, str] | None = None
    value_shape: tuple[int | None, ...] = ()

    def per_batch(self, samples: int) -> bool:
        """Whether it gives one value for the whole batch of ``samples``, not one per sample (a
        loss that reduces over the batch: Keras' Dice and Tversky with ``axis=None``). foldsweep's
        step weighs each sample's loss (class weights), leaves a padded batch's extra samples out
        of it, and sums the validation fold's sample by sample, which one value per batch cannot be."""
        return self.problem is None and self.value_shape[:1] != (samples,)


def traced_loss(loss: TrainingLoss, outputs: np.ndarray) -> TracedLoss:
    """``loss`` traced once on the model's ``outputs`` for as many labels of class 0."""
    import tensorflow as tf

    labels = tf.zeros(outputs.shape[:-1], tf.int64)
    try:
        traced = tf.function(loss.per_sample, autograph=False).get_concrete_function(labels, tf.constant(outputs))
    except tf.errors.OperatorNotAllowedInGraphError as exc:
        return TracedLoss(problem=(_first_sentence(exc), "write the condition with tf.where or tf.cond"))
    except Exception as exc:  # whatever fails in the trace fails in fit's step too
        return TracedLoss(
            problem=(
                f"{type(exc).__name__}: {_first_sentence(exc)}",
                "write it with tensor operations (keras.ops or tf), without NumPy or Python values of tensors",
            )
        )
    return TracedLoss(value_shape=tuple(traced.structured_outputs.shape))


def _first_sentence(exc: Exception) -> str:
    """The error's first sentence; TensorFlow's rest is advice about AutoGraph."""
    return re.split(r"\.\s", str(exc).strip(), maxsplit=1)[0]
