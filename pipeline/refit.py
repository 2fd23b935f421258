"""Refit: the best config trained on the whole CV training split, scored on the held-out test split."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.engine.recipe import TrainingRecipe
from pipeline.inputs.datasets import Dataset
from pipeline.inputs.folds import Fold

REFIT_MODEL_ARTIFACT = "refit_model.keras"


@dataclass(frozen=True)
class RefitResult:
    test_loss: float
    test_accuracy: float | None  # None for regression
    epochs: int
    model_path: Path
    # Every other metric the trials computed, on the test split: {name: value}, recorded as test_<name>.
    test_metrics: Mapping[str, float] = field(default_factory=dict)


def refit(
    build_fn: Any, config: Mapping[str, Any], dataset: Dataset, *, epochs: int, recipe: TrainingRecipe, directory: Path
) -> RefitResult:
    """Train ``config`` on all of ``dataset.x``/``y`` for ``epochs`` and score it on the test split,
    trained with the sweep's trials' ``recipe``.

    The test split joins the device-resident arrays only here, as the validation "fold" of one
    model that never trained on it.
    """
    from pipeline.engine.resident import resident_data
    from pipeline.engine.trainer import build_trainer

    x = np.concatenate([dataset.x, dataset.x_test])
    y = np.concatenate([dataset.y, dataset.y_test])
    n_train = len(dataset.y)
    fold = Fold(train=np.arange(n_train), val=np.arange(n_train, len(y)))
    trainer = build_trainer(
        build_fn,
        config,
        recipe,
        data=resident_data(f"{dataset.fingerprint}+test", x, y),
        folds=[fold],
        planned_epochs=epochs,
    )
    for _ in range(epochs):
        result = trainer.run_epoch()
    path = directory / REFIT_MODEL_ARTIFACT
    trainer.models[0].save(path)
    scores = result.folds[0]
    return RefitResult(
        test_loss=scores.val_loss,
        test_accuracy=scores.val_accuracy,
        epochs=epochs,
        model_path=path,
        test_metrics=dict(scores.metrics),
    )


def refit_scores(result: RefitResult) -> dict[str, float]:
    scores = {
        "test_loss": result.test_loss,
        "test_accuracy": result.test_accuracy,
        **{f"test_{name}": value for name, value in result.test_metrics.items()},
    }
    return {key: value for key, value in scores.items() if value is not None and math.isfinite(value)}
