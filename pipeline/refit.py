"""Refit: the best config trained on the whole CV training split, scored on the held-out test split."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from pipeline.datasets import Dataset
from pipeline.folds import Fold
from pipeline.trial import TrialSettings

REFIT_MODEL_ARTIFACT = "refit_model.keras"


@dataclass(frozen=True)
class RefitResult:
    test_loss: float
    test_accuracy: float
    epochs: int
    model_path: Path


def refit(build_fn: Any, config: Mapping[str, Any], dataset: Dataset, *, epochs: int, settings: TrialSettings,
          directory: Path) -> RefitResult:
    """Train ``config`` on all of ``dataset.x``/``y`` for ``epochs`` and score it on the test split,
    executed as the sweep's trials are (``settings``).

    The test split joins the device-resident arrays only here, as the validation "fold" of one
    model that never trained on it.
    """
    from pipeline.resident import resident_data
    from pipeline.space import resolve_config
    from pipeline.trainer import build_trainer
    from pipeline.trial import trial_values

    x = np.concatenate([dataset.x, dataset.x_test])
    y = np.concatenate([dataset.y, dataset.y_test])
    n_train = len(dataset.y)
    fold = Fold(train=np.arange(n_train), val=np.arange(n_train, len(y)))
    params, model_values, _ = trial_values(resolve_config(config, settings.conditions), settings)
    trainer = build_trainer(build_fn, model_values, params,
                            data=resident_data(f"{dataset.fingerprint}+test", x, y), folds=[fold], seed=settings.seed,
                            choices=settings.choices, from_logits=settings.from_logits, planned_epochs=epochs,
                            spec_names=settings.spec_names)
    for _ in range(epochs):
        result = trainer.run_epoch()
    path = directory / REFIT_MODEL_ARTIFACT
    trainer.models[0].save(path)
    scores = result.folds[0]
    return RefitResult(test_loss=scores.val_loss, test_accuracy=scores.val_accuracy, epochs=epochs, model_path=path)


def refit_scores(result: RefitResult) -> dict[str, float]:
    return {key: value for key, value in {"test_loss": result.test_loss, "test_accuracy": result.test_accuracy}.items()
            if math.isfinite(value)}
