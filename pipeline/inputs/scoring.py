"""What a trial is scored on: the one place that knows each validation metric's name and direction.

Every fold is scored as Keras' ``evaluate`` scores a compiled model: the loss (per-sample values
over the whole validation fold), the accuracy of a classifier, and each metric the model compiles
(``compile(metrics=..., weighted_metrics=...)``) or the spec names (``train.metrics``), accumulated
by Keras' own stateful metric objects (AUC's confusion counts, RMSE's sums, a researcher's
``keras.metrics.Metric`` subclass) through ``update_state`` inside the compiled evaluation and read
with ``result()`` once the fold's validation samples are all in: never a mean of batch means.

Keras' ``CompileMetrics`` is what ``compile`` builds from those arguments; foldsweep builds one per
fold model from the same arguments, so the names and the metric chosen for ``"acc"`` are Keras'.
A ``Scorer`` is what the rest of foldsweep knows of a metric: its name (Keras' ``name``, recorded
as ``val_<name>``), its direction (KerasTuner's rule, with the max metrics it misses), and the
worst score a fold that went NaN counts as.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.base.keras_private import compile_metrics, compiled_metric_arguments

Direction = Literal["max", "min"]
# The scores foldsweep computes itself, whatever the model compiles: the loss, and the accuracy of
# a classifier (Keras' accuracy for the model's head, ``pipeline.inputs.losses``).
OWN_SCORES: Mapping[str, Direction] = {"loss": "min", "accuracy": "max"}
# Which way each Keras metric improves, by class name and by the names Keras gives it (its default
# ``name`` and the string identifiers ``compile`` takes): KerasTuner's rule (``infer_metric_direction``:
# accuracies, AUC, precision, recall and the like are max, everything else in keras.metrics min)
# with what that rule gets wrong put right (F-scores, R2, correlations, IoU and the at-threshold
# metrics improve upwards). Written out rather than asked of Keras, because the spec is read
# before TensorFlow may start (a trial's thread pools are set first); tests/test_scoring.py
# checks it against KerasTuner and Keras.
_MAX = (
    "AUC",
    "auc",
    "Accuracy",
    "accuracy",
    "acc",
    "BinaryAccuracy",
    "binary_accuracy",
    "CategoricalAccuracy",
    "categorical_accuracy",
    "SparseCategoricalAccuracy",
    "sparse_categorical_accuracy",
    "TopKCategoricalAccuracy",
    "top_k_categorical_accuracy",
    "SparseTopKCategoricalAccuracy",
    "sparse_top_k_categorical_accuracy",
    "Precision",
    "precision",
    "Recall",
    "recall",
    "PrecisionAtRecall",
    "RecallAtPrecision",
    "SensitivityAtSpecificity",
    "SpecificityAtSensitivity",
    "TruePositives",
    "true_positives",
    "TrueNegatives",
    "true_negatives",
    "F1Score",
    "f1_score",
    "FBetaScore",
    "fbeta_score",
    "R2Score",
    "r2_score",
    "CosineSimilarity",
    "cosine_similarity",
    "PearsonCorrelation",
    "pearson_correlation",
    "ConcordanceCorrelation",
    "concordance_correlation",
    "IoU",
    "MeanIoU",
    "mean_iou",
    "BinaryIoU",
    "binary_iou",
    "OneHotIoU",
    "OneHotMeanIoU",
)
_MIN = (
    "loss",
    "BinaryCrossentropy",
    "binary_crossentropy",
    "CategoricalCrossentropy",
    "categorical_crossentropy",
    "SparseCategoricalCrossentropy",
    "sparse_categorical_crossentropy",
    "binary_focal_crossentropy",
    "categorical_focal_crossentropy",
    "CategoricalHinge",
    "categorical_hinge",
    "Hinge",
    "hinge",
    "SquaredHinge",
    "squared_hinge",
    "KLDivergence",
    "kl_divergence",
    "kld",
    "LogCoshError",
    "log_cosh",
    "logcosh",
    "log_cosh_error",
    "MeanAbsoluteError",
    "mean_absolute_error",
    "mae",
    "MeanAbsolutePercentageError",
    "mean_absolute_percentage_error",
    "mape",
    "MeanSquaredError",
    "mean_squared_error",
    "mse",
    "MeanSquaredLogarithmicError",
    "mean_squared_logarithmic_error",
    "msle",
    "RootMeanSquaredError",
    "root_mean_squared_error",
    "rmse",
    "Poisson",
    "poisson",
    "huber",
    "Huber",
    "FalsePositives",
    "false_positives",
    "FalseNegatives",
    "false_negatives",
)
KNOWN_DIRECTIONS: Mapping[str, Direction] = {**{name: "min" for name in _MIN}, **{name: "max" for name in _MAX}}
# What a fold that went NaN counts as in its trial's CV mean and std: the worst score, finite, so
# that no NaN reaches a searcher (the fold's own split{k} value stays NaN in the record).
WORST_HIGH = 1e6
WORST_LOW = -1e6


@dataclass(frozen=True)
class Scorer:
    """One validation score: recorded as ``val_<name>``; ``direction`` None when neither Keras nor
    KerasTuner says which way it improves (such a metric is recorded, but ranks nothing unless
    ``train.mode`` says)."""

    name: str
    direction: Direction | None
    scalar: bool = True

    @property
    def worst(self) -> float:
        """The score a NaN fold counts as: 0 for accuracy (as before), else far beyond any real one."""
        if self.name == "accuracy":
            return 0.0
        if self.direction is None:
            return math.nan
        return WORST_LOW if self.direction == "max" else WORST_HIGH


def is_regression(y: Any) -> bool:
    """The task kind, decided once from the targets: float targets are regressed (any shape),
    integer ones are class labels."""
    import numpy as np

    return np.asarray(y).dtype.kind == "f"


def is_per_position(y: Any) -> bool:
    """Integer labels with more than one per sample (``(n, L, ...)``, one per residue of a
    window): sequence labelling, for a model whose output has those axes plus a class axis."""
    import numpy as np

    y = np.asarray(y)
    return y.dtype.kind in "iu" and y.ndim >= 2


def direction_of(metric: Any) -> Direction | None:
    """Which way a metric (a Keras metric object, or a name) improves (``KNOWN_DIRECTIONS``);
    None when unknown, as for a researcher's own Metric subclass."""
    if isinstance(metric, str):
        return KNOWN_DIRECTIONS.get(metric)
    cls = type(metric)
    if not (getattr(cls, "__module__", "") or "").startswith("keras"):
        return None  # a researcher's own Metric: its name says nothing of its direction
    if cls.__name__ == "MeanMetricWrapper":  # a metric function compile wrapped, named as compile was given it
        return KNOWN_DIRECTIONS.get(getattr(metric, "name", ""))
    return KNOWN_DIRECTIONS.get(cls.__name__)


def is_keras_accuracy(metric: Any) -> bool:
    """Whether a ``compile`` metric is Keras' "accuracy", which foldsweep scores itself for a
    classifier, by the rule Keras picks for the model's head (``TrainingLoss.correct``)."""
    return isinstance(metric, str) and metric == "accuracy"


def compiles_keras_accuracy(model: Any) -> bool:
    """Whether ``model`` compiles Keras' "accuracy", in ``metrics`` or ``weighted_metrics``."""
    metrics, weighted = compiled_metric_arguments(model)
    return any(is_keras_accuracy(metric) for metric in (*metrics, *weighted))


def compiles_named_accuracy(model: Any) -> bool:
    """Whether ``model`` compiles a metric of its own under the name "accuracy" (not Keras' string),
    which ``ValidationMetrics`` scores as the classifier's accuracy."""
    metrics, weighted = compiled_metric_arguments(model)
    return any(
        not isinstance(metric, str)
        and (getattr(metric, "name", None) or getattr(metric, "__name__", None)) == "accuracy"
        for metric in (*metrics, *weighted)
    )


def scored_metric_arguments(model: Any, extra: Sequence[str] = (), *, own_accuracy: bool = True) -> tuple[list, list]:
    """The ``metrics`` and ``weighted_metrics`` a fold's ``ValidationMetrics`` scores: the model's
    compiled ones and the spec's ``train.metrics`` (``extra``), less Keras' "accuracy" where
    foldsweep scores the accuracy itself (the same rule as Keras' "accuracy" string)."""
    metrics, weighted = compiled_metric_arguments(model)
    metrics = [*metrics, *extra]
    if own_accuracy:
        metrics = [metric for metric in metrics if not is_keras_accuracy(metric)]
        weighted = [metric for metric in weighted if not is_keras_accuracy(metric)]
    return metrics, weighted


class ValidationMetrics:
    """One fold's stateful validation metrics (Keras' ``CompileMetrics``), built on the model's
    compile arguments plus the spec's ``train.metrics``; ``update`` runs inside the compiled
    evaluation, ``results`` reads them after the fold's last batch."""

    def __init__(self, model: Any, extra: Sequence[str] = (), *, own_accuracy: bool = True):
        metrics, weighted = scored_metric_arguments(model, extra, own_accuracy=own_accuracy)
        self._own = OWN_SCORES if own_accuracy else {"loss": "min"}
        self._compiled = compile_metrics(metrics, weighted) if metrics or weighted else None
        self.names: tuple[str, ...] = ()
        self._accuracy: Any = None

    def build(self, labels: Any, predictions: Any) -> None:
        """Create the metrics' variables (before the evaluation is traced), on real shapes: those a
        metric makes at its first update too (F1Score's, R2Score's, a multi-label AUC's), which also
        tries each metric on the labels and outputs as the evaluation will give them."""
        if self._compiled is None:
            return
        self._compiled.build(labels, predictions)
        self._compiled.update_state(labels, predictions)
        self._compiled.reset_state()
        self.names = tuple(metric.name for metric in self._compiled.metrics if metric.name not in self._own)
        named = [metric for metric in self._compiled.metrics if metric.name == "accuracy"]
        self._accuracy = named[0] if named and "accuracy" in self._own else None

    def compiled_accuracy(self) -> float | None:
        """The value of a metric the model compiles under the name "accuracy" (a
        ``BinaryAccuracy(name="accuracy", threshold=0.8)``), which is the classifier's accuracy as
        evaluate reports it, in place of foldsweep's own; None without one."""
        return None if self._accuracy is None else float(self._accuracy.result())

    def update(self, labels: Any, predictions: Any) -> None:
        if self._compiled is not None:
            self._compiled.update_state(labels, predictions)

    def reset(self) -> None:
        if self._compiled is not None:
            self._compiled.reset_state()

    def results(self) -> dict[str, Any]:
        """Each metric's value over everything ``update`` saw since ``reset`` (arrays)."""
        if self._compiled is None:
            return {}
        import numpy as np

        values = self._compiled.result()
        return {name: np.asarray(values[name]) for name in self.names}

    def scorers(self) -> tuple[Scorer, ...]:
        """A ``Scorer`` for each metric (after ``build``)."""
        if self._compiled is None:
            return ()
        import numpy as np

        values = self._compiled.result()
        return tuple(
            Scorer(metric.name, direction_of(metric), np.asarray(values[metric.name]).size == 1)
            for metric in self._compiled.metrics
            if metric.name not in self._own
        )


def objective_problem(
    metric: str, mode: str | None, scorers: Sequence[Scorer], *, classifier: bool
) -> tuple[str, Any] | None:
    """Why ``train.metric`` cannot be the objective of a model that computes ``scorers``: (the
    YAML key, the message without the key); None when it can."""
    computed = {
        **({"accuracy": Scorer("accuracy", "max")} if classifier else {}),
        "loss": Scorer("loss", "min"),
        **{scorer.name: scorer for scorer in scorers},
    }
    if metric not in computed:
        return "metric", (
            f"must be a score the model computes ({', '.join(computed)}: its loss, accuracy for a "
            "classifier, the metrics of its compile(metrics=...) and of train.metrics)"
        )
    scorer = computed[metric]
    if not scorer.scalar:
        return "metric", (
            f"must be a metric with one value per fold; {metric} gives one per class (e.g. "
            "F1Score(average=None)): compile it with average='macro' or 'weighted' to rank on it"
        )
    if mode is None and scorer.direction is None:
        return "mode", (
            f"is required for train.metric {metric}: neither Keras nor KerasTuner knows whether a higher "
            f"{metric} is better (max) or worse (min)"
        )
    return None
