"""Train the k fold models of one trial in lockstep, one epoch at a time.

Each call to ``FoldTrainer.run_epoch`` trains every fold model for one epoch and returns the
epoch's results in scikit-learn's vocabulary (``split{k}_val_<metric>``, ``mean_val_<metric>``,
``std_val_<metric>``), the same keys Ray Tune, MLflow and ``cv_results.csv`` use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import keras
import numpy as np

from pipeline.folds import Fold
from pipeline.hypermodel import build_model

METRIC_NAMES: tuple[str, ...] = ("loss", "accuracy")
EVAL_BATCH_SIZE = 1024


@dataclass(frozen=True)
class TrainingParams:
    batch_size: int
    learning_rate: float
    optimizer: str


def make_optimizer(params: TrainingParams) -> keras.optimizers.Optimizer:
    if params.optimizer == "adam":
        return keras.optimizers.Adam(learning_rate=params.learning_rate)
    if params.optimizer == "adamw":
        return keras.optimizers.AdamW(learning_rate=params.learning_rate)
    if params.optimizer == "sgd":
        return keras.optimizers.SGD(learning_rate=params.learning_rate, momentum=0.9)
    if params.optimizer == "rmsprop":
        return keras.optimizers.RMSprop(learning_rate=params.learning_rate)
    raise ValueError(f"unknown optimizer {params.optimizer!r}")


def fold_seed(trial_seed: int, fold: int) -> int:
    """Each fold's initialisation and shuffling seed, independent of which trials ran before."""
    return int(np.random.SeedSequence([trial_seed, fold]).generate_state(1)[0])


def cv_summary(per_fold: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per-fold results -> split{k}_<key>, mean_<key>, std_<key> (population std, as sklearn)."""
    summary: dict[str, float] = {}
    for key in per_fold[0]:
        values = np.array([fold[key] for fold in per_fold], dtype=np.float64)
        for k, value in enumerate(values):
            summary[f"split{k}_{key}"] = float(value)
        summary[f"mean_{key}"] = float(values.mean())
        summary[f"std_{key}"] = float(values.std())
    return summary


class FoldTrainer:
    """The k fold models of one trial, their data and their epoch counter."""

    def __init__(
        self,
        build_fn: Callable[[Any], keras.Model],
        model_values: Mapping[str, Any],
        params: TrainingParams,
        *,
        x: np.ndarray,
        y: np.ndarray,
        folds: Sequence[Fold],
        seed: int,
        from_logits: bool = False,
    ):
        self.params = params
        self.epoch = 0
        self._models: list[keras.Model] = []
        self._fold_data = []
        for k, fold in enumerate(folds):
            keras.utils.set_random_seed(fold_seed(seed, k))
            model = build_model(build_fn, model_values)
            model.compile(
                optimizer=make_optimizer(params),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits),
                metrics=["accuracy"],
            )
            self._models.append(model)
            self._fold_data.append((x[fold.train], y[fold.train], x[fold.val], y[fold.val]))

    @property
    def models(self) -> list[keras.Model]:
        return self._models

    def run_epoch(self) -> dict[str, float]:
        """Train every fold one more epoch, then validate each; returns the CV summary."""
        per_fold = []
        for model, (x_train, y_train, x_val, y_val) in zip(self._models, self._fold_data):
            history = model.fit(
                x_train, y_train, batch_size=self.params.batch_size, epochs=self.epoch + 1,
                initial_epoch=self.epoch, shuffle=True, verbose=0,
            )
            scores = model.evaluate(x_val, y_val, batch_size=EVAL_BATCH_SIZE, verbose=0, return_dict=True)
            per_fold.append({
                "train_loss": float(history.history["loss"][-1]),
                **{f"val_{name}": float(scores[name]) for name in METRIC_NAMES},
            })
        self.epoch += 1
        return {"epoch": self.epoch, **cv_summary(per_fold)}

    def state(self) -> dict[str, np.ndarray]:
        """Weights, optimizer state and epoch of every fold model, as plain arrays."""
        arrays = {"epoch": np.array(self.epoch)}
        for k, model in enumerate(self._models):
            for i, variable in enumerate(model.weights):
                arrays[f"fold{k}/weight{i}"] = np.asarray(variable)
            for i, variable in enumerate(model.optimizer.variables):
                arrays[f"fold{k}/optimizer{i}"] = np.asarray(variable)
        return arrays

    def load_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore what ``state`` returned; the models must have been built from the same config."""
        self.epoch = int(arrays["epoch"])
        for k, model in enumerate(self._models):
            for i, variable in enumerate(model.weights):
                variable.assign(arrays[f"fold{k}/weight{i}"])
            model.optimizer.build(model.trainable_variables)
            for i, variable in enumerate(model.optimizer.variables):
                variable.assign(arrays[f"fold{k}/optimizer{i}"])
