"""One trial = one config over all k folds, as a Ray Tune class trainable.

A class trainable (not a function) so that Ray Tune can keep a worker process across trials
(``reuse_actors``): ``reset_config`` drops the previous trial's models and Keras state and starts
the next trial in the same process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ray import tune

from pipeline.folds import Fold

CHECKPOINT_FILE = "folds.npz"


@dataclass(frozen=True)
class TrialSettings:
    """What every trial of a sweep shares, besides the data and folds."""

    experiment_path: str
    experiment_attr: str
    epochs: int
    seed: int
    from_logits: bool
    cpus: float


class FoldTrainable(tune.Trainable):
    """Trains one config over all folds; each ``step`` is one epoch of every fold."""

    def setup(self, config: Mapping[str, Any], *, data: Mapping[str, Any], folds: Sequence[Fold],
              settings: TrialSettings) -> None:
        _limit_threads(settings.cpus)
        from pipeline.hypermodel import load_builder

        self._x, self._y = data["x"], data["y"]
        self._folds = folds
        self._settings = settings
        self._build_fn = load_builder(Path(settings.experiment_path), settings.experiment_attr)
        self._start(config)

    def _start(self, config: Mapping[str, Any]) -> None:
        from pipeline.space import split_config
        from pipeline.training import FoldTrainer, TrainingParams

        training, model_values = split_config(config)
        self._trainer = FoldTrainer(
            self._build_fn, model_values, TrainingParams(**training),
            x=self._x, y=self._y, folds=self._folds, seed=self._settings.seed,
            from_logits=self._settings.from_logits,
        )

    def step(self) -> dict[str, Any]:
        result = self._trainer.run_epoch()
        result["done"] = self._trainer.epoch >= self._settings.epochs
        return result

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        import keras

        # Nothing of the previous trial (models, optimizers, traced graphs) may survive into
        # the next one: dropping the references and clearing Keras' global state does that.
        self._trainer = None
        keras.backend.clear_session()
        self._start(new_config)
        return True

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        import numpy as np

        np.savez(Path(checkpoint_dir) / CHECKPOINT_FILE, **self._trainer.state())

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        import numpy as np

        with np.load(Path(checkpoint_dir) / CHECKPOINT_FILE) as arrays:
            self._trainer.load_state(arrays)

    def cleanup(self) -> None:
        self._trainer = None


def _limit_threads(cpus: float) -> None:
    """Keep TensorFlow inside the trial's CPU share, so concurrent trials do not oversubscribe."""
    threads = max(1, int(cpus))
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", str(threads))
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:
        pass  # TensorFlow already initialised in this process by an earlier trial
