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
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

Direction = Literal["max", "min"]
# The scores foldsweep computes itself, whatever the model compiles: the loss, and the accuracy of
# a classifier (Keras' accuracy for the model's head, ``pipeline.inputs.losses``).
OWN_SCORES: Mapping[str, Direction] = {"loss": "min", "accuracy": "max"}
# Keras metrics that improve upwards which KerasTuner's name rule (``infer_metric_direction``)
# takes for errors: it calls every other class in keras.metrics "min".
_MAX_CLASSES = frozenset({"F1Score", "FBetaScore", "R2Score", "IoU", "MeanIoU", "BinaryIoU", "OneHotIoU",
                          "OneHotMeanIoU", "PrecisionAtRecall", "RecallAtPrecision", "SensitivityAtSpecificity",
                          "SpecificityAtSensitivity", "TruePositives", "TrueNegatives"})
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


def direction_of(metric: Any) -> Direction | None:
    """Which way a metric (a Keras metric object, or a name) improves, as KerasTuner infers it,
    with the max metrics its rule misses; None when unknown."""
    from keras_tuner.engine.metrics_tracking import infer_metric_direction

    if isinstance(metric, str) and metric in OWN_SCORES:
        return OWN_SCORES[metric]
    if isinstance(metric, str):
        import keras

        try:  # a name Keras knows: its class says what KerasTuner's rule misses
            if type(keras.metrics.get(metric)).__name__ in _MAX_CLASSES:
                return "max"
        except Exception:
            pass
    if type(metric).__name__ in _MAX_CLASSES or (isinstance(metric, str) and metric in _MAX_CLASSES):
        return "max"
    module = getattr(type(metric), "__module__", "") or ""
    if not isinstance(metric, str) and not module.startswith("keras"):
        return None  # a researcher's own Metric: its class name says nothing KerasTuner could read
    try:
        return infer_metric_direction(metric)
    except Exception:
        return None


def compiled_metric_arguments(model: Any) -> tuple[list[Any], list[Any]]:
    """The ``metrics`` and ``weighted_metrics`` a model was compiled with (empty when it was not)."""
    compiled = getattr(model, "_compile_metrics", None)
    if compiled is None:
        return [], []
    return list(getattr(compiled, "_user_metrics", None) or []), list(getattr(compiled, "_user_weighted_metrics",
                                                                                  None) or [])


class ValidationMetrics:
    """One fold's stateful validation metrics (Keras' ``CompileMetrics``), built on the model's
    compile arguments plus the spec's ``train.metrics``; ``update`` runs inside the compiled
    evaluation, ``results`` reads them after the fold's last batch."""

    def __init__(self, model: Any, extra: Sequence[str] = ()):
        from keras.src.trainers.compile_utils import CompileMetrics

        metrics, weighted = compiled_metric_arguments(model)
        # The accuracy foldsweep computes itself (the same rule as Keras' "accuracy" string).
        metrics = [metric for metric in [*metrics, *extra] if not (isinstance(metric, str) and metric == "accuracy")]
        weighted = [metric for metric in weighted if not (isinstance(metric, str) and metric == "accuracy")]
        self._compiled = CompileMetrics(metrics, weighted) if metrics or weighted else None
        self.names: tuple[str, ...] = ()

    def build(self, labels: Any, predictions: Any) -> None:
        """Create the metrics' variables (before the evaluation is traced), on real shapes."""
        if self._compiled is None:
            return
        self._compiled.build(labels, predictions)
        self.names = tuple(metric.name for metric in self._compiled.metrics if metric.name not in OWN_SCORES)

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
        return tuple(Scorer(metric.name, direction_of(metric), np.asarray(values[metric.name]).size == 1)
                     for metric in self._compiled.metrics if metric.name not in OWN_SCORES)


def objective_problem(metric: str, mode: str | None, scorers: Sequence[Scorer], *,
                      classifier: bool) -> tuple[str, Any] | None:
    """Why ``train.metric`` cannot be the objective of a model that computes ``scorers``: (the
    YAML key, the message without the key); None when it can."""
    computed = {**({"accuracy": Scorer("accuracy", "max")} if classifier else {}), "loss": Scorer("loss", "min"),
                **{scorer.name: scorer for scorer in scorers}}
    if metric not in computed:
        return "metric", (f"must be a score the model computes ({', '.join(computed)}: its loss, accuracy for a "
                          "classifier, the metrics of its compile(metrics=...) and of train.metrics)")
    scorer = computed[metric]
    if not scorer.scalar:
        return "metric", (f"must be a metric with one value per fold; {metric} gives one per class (e.g. "
                          "F1Score(average=None)): compile it with average='macro' or 'weighted' to rank on it")
    if mode is None and scorer.direction is None:
        return "mode", (f"is required for train.metric {metric}: neither Keras nor KerasTuner knows whether a higher "
                        f"{metric} is better (max) or worse (min)")
    return None


def resolved_mode(metric: str, mode: str | None, scorers: Sequence[Scorer]) -> Direction:
    """The objective's direction: ``train.mode`` when given, else the metric's own."""
    if mode is not None:
        return mode  # type: ignore[return-value]
    known = {**OWN_SCORES, **{scorer.name: scorer.direction for scorer in scorers}}
    return known[metric]  # type: ignore[return-value]
