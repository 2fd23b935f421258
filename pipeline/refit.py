"""Refit: the best config trained on the whole CV training split, scored on the held-out test split."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from pipeline.datasets import Dataset
from pipeline.folds import Fold

REFIT_MODEL_ARTIFACT = "refit_model.keras"


@dataclass(frozen=True)
class RefitResult:
    test_loss: float
    test_accuracy: float
    epochs: int
    model_path: Path


def refit(build_fn: Any, config: Mapping[str, Any], dataset: Dataset, *, epochs: int, seed: int,
          from_logits: bool, jit_compile: str, conditions: Mapping[str, Any], directory: Path) -> RefitResult:
    """Train ``config`` on all of ``dataset.x``/``y`` for ``epochs`` and score it on the test split.

    The test split joins the device-resident arrays only here, as the validation "fold" of one
    model that never trained on it.
    """
    from pipeline.resident import resident_data
    from pipeline.space import resolve_config, split_config
    from pipeline.trainer import FoldTrainer
    from pipeline.training import TrainingParams

    x = np.concatenate([dataset.x, dataset.x_test])
    y = np.concatenate([dataset.y, dataset.y_test])
    n_train = len(dataset.y)
    fold = Fold(train=np.arange(n_train), val=np.arange(n_train, len(y)))
    training, model_values = split_config(resolve_config(config, conditions))
    training.pop("epochs")
    trainer = FoldTrainer(build_fn, model_values, TrainingParams(**training),
                          data=resident_data(f"{dataset.fingerprint}+test", x, y), folds=[fold], seed=seed,
                          from_logits=from_logits, jit_compile=jit_compile)
    for _ in range(epochs):
        result = trainer.run_epoch()
    path = directory / REFIT_MODEL_ARTIFACT
    trainer.models[0].save(path)
    return RefitResult(test_loss=result["split0_val_loss"], test_accuracy=result["split0_val_accuracy"],
                       epochs=epochs, model_path=path)


def refit_scores(result: RefitResult) -> dict[str, float]:
    return {key: value for key, value in {"test_loss": result.test_loss, "test_accuracy": result.test_accuracy}.items()
            if math.isfinite(value)}
