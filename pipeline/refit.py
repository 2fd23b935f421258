"""Refit: the best config trained on the whole CV training split, scored on the held-out test split.

The refit trains in the driver. ``EarlyRefit`` starts it beside the last trials, on the slot the
trials no longer need, for the best trial so far; the sweep keeps it where that trial is still
the best when every trial has ended, and refits the new best after them where it is not.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ray.tune import Callback

from pipeline.engine.recipe import TrainingRecipe
from pipeline.inputs.datasets import Dataset
from pipeline.inputs.folds import Fold
from pipeline.records.callbacks import slot_free

REFIT_MODEL_ARTIFACT = "refit_model.keras"
# The refit as an MLflow Model (``pipeline.records.model_package``), logged as the sweep's model.
REFIT_MODEL_NAME = "refit_model"


@dataclass(frozen=True)
class RefitResult:
    test_loss: float
    test_accuracy: float | None  # None for regression
    epochs: int
    model_path: Path
    # Every other metric the trials computed, on the test split: {name: value}, recorded as test_<name>.
    test_metrics: Mapping[str, float] = field(default_factory=dict)
    # The model as an MLflow Model directory, where the refit was given its experiment module;
    # else why there is none ("" where none was asked for).
    package_path: Path | None = None
    package_error: str = ""


@dataclass(frozen=True)
class RefitTarget:
    """What a refit trains: a trial's config, for the epochs the trial was scored at."""

    trial_id: str
    run_id: str
    run_name: str
    config: Mapping[str, Any]
    epochs: int


class RefitStopped(Exception):
    """A refit was stopped between two epochs (``PreparedRefit.train``'s ``stop``)."""


class PreparedRefit:
    """A refit's model, built and seeded, to be trained by ``train``."""

    def __init__(
        self,
        build_fn: Any,
        config: Mapping[str, Any],
        dataset: Dataset,
        *,
        epochs: int,
        recipe: TrainingRecipe,
        experiment_path: Path | None = None,
    ):
        """Build ``config``'s model as a trial builds a fold's, with the sweep's trials' ``recipe``,
        on all of ``dataset.x``/``y``, with the test split as its validation "fold": the test split
        joins the device-resident arrays only here, as the validation data of one model that never
        trains on it. With ``experiment_path`` (the module ``build_fn`` comes from), ``train``
        also saves the model as an MLflow Model that carries the module."""
        from pipeline.engine.resident import resident_data
        from pipeline.engine.trainer import build_trainer

        x = np.concatenate([dataset.x, dataset.x_test])
        y = np.concatenate([dataset.y, dataset.y_test])
        n_train = len(dataset.y)
        fold = Fold(train=np.arange(n_train), val=np.arange(n_train, len(y)))
        self.epochs = epochs
        self._x_train = dataset.x
        self._experiment_path = experiment_path
        self._trainer = build_trainer(
            build_fn,
            config,
            recipe,
            data=resident_data(f"{dataset.fingerprint}+test", x, y, one_hot=dataset.one_hot),
            folds=[fold],
            planned_epochs=epochs,
        )

    def train(self, directory: Path, *, stop: threading.Event | None = None) -> RefitResult:
        """Train the epochs, save the model in ``directory`` and score it on the test split.

        Raises:
            RefitStopped: ``stop`` was set (tested before each epoch).
        """
        for _ in range(self.epochs):
            if stop is not None and stop.is_set():
                raise RefitStopped
            result = self._trainer.run_epoch()
        path = directory / REFIT_MODEL_ARTIFACT
        model = self._trainer.model_with_trained_optimizer()
        model.save(path)
        package, package_error = None, ""
        if self._experiment_path is not None:
            from pipeline.records.model_package import write_model_package

            try:
                package = write_model_package(
                    model, directory / REFIT_MODEL_NAME, x_train=self._x_train, experiment_path=self._experiment_path
                )
            except Exception as exc:  # the refit and its scores stand without it
                package_error = f"{type(exc).__name__}: {exc}"
        scores = result.folds[0]
        return RefitResult(
            test_loss=scores.val_loss,
            test_accuracy=scores.val_accuracy,
            epochs=self.epochs,
            model_path=path,
            test_metrics=dict(scores.metrics),
            package_path=package,
            package_error=package_error,
        )


def refit(
    build_fn: Any,
    config: Mapping[str, Any],
    dataset: Dataset,
    *,
    epochs: int,
    recipe: TrainingRecipe,
    directory: Path,
    experiment_path: Path | None = None,
) -> RefitResult:
    """Train ``config`` on all of ``dataset.x``/``y`` for ``epochs`` and score it on the test split,
    trained with the sweep's trials' ``recipe`` (``PreparedRefit``)."""
    prepared = PreparedRefit(build_fn, config, dataset, epochs=epochs, recipe=recipe, experiment_path=experiment_path)
    return prepared.train(directory)


def refit_scores(result: RefitResult) -> dict[str, float]:
    scores = {
        "test_loss": result.test_loss,
        "test_accuracy": result.test_accuracy,
        **{f"test_{name}": value for name, value in result.test_metrics.items()},
    }
    return {key: value for key, value in scores.items() if value is not None and math.isfinite(value)}


class _Refitting:
    """One refit training in a thread of its own, into a directory of its own."""

    def __init__(self, target: RefitTarget, prepare: Callable[[RefitTarget], PreparedRefit]):
        self.target = target
        self.stop = threading.Event()
        self.directory = Path(tempfile.mkdtemp(prefix="foldsweep-refit-"))
        self.result: RefitResult | None = None
        self.failed = False
        self._built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(prepare,), name="early-refit", daemon=True)
        self._thread.start()
        # The build seeds Python's and NumPy's global generators and draws the initializers'
        # seeds from them (as Keras' set_random_seed has them), and Ray Tune's loop in this
        # thread shuffles with Python's: the loop waits until the model is built.
        self._built.wait()

    def _run(self, prepare: Callable[[RefitTarget], PreparedRefit]) -> None:
        try:
            try:
                prepared = prepare(self.target)
            finally:
                self._built.set()
            self.result = prepared.train(self.directory, stop=self.stop)
        except Exception:  # stopped, or failed beside the trials: refit again after them
            self.failed = True

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def outcome(self) -> RefitResult | None:
        """Its result once it has ended; None if it was stopped or failed."""
        self._thread.join()
        return None if self.failed else self.result

    def discard(self) -> None:
        """Stop it (after the epoch it is training), wait for it, and delete what it saved."""
        self.stop.set()
        self._thread.join()
        shutil.rmtree(self.directory, ignore_errors=True)


class EarlyRefit(Callback):
    """Ray Tune callback: the refit of the best trial so far, started in the driver beside the
    last trials once no trial is left to start and a slot is free (the sweep's refit is that
    trial's if it is still the best when every trial has ended).

    A trial that ends and takes the lead stops the refit of the one it overtook (after the epoch
    in training) and has its own started. The refit is the same as after the trials: the same
    build, seeds and training, in the same process.
    """

    def __init__(
        self,
        *,
        slots: int,
        n_trials: int,
        best: Callable[[Mapping[str, Mapping[str, Any]]], RefitTarget | None],
        prepare: Callable[[RefitTarget], PreparedRefit],
        on_start: Callable[[RefitTarget, int], None] = lambda target, running: None,
    ):
        """``slots`` trials run at once at most, ``n_trials`` make the sweep; ``best(configs)``
        is the refit of the best trial ended so far (``configs``: every trial's by trial id), or
        None; ``prepare`` builds a refit's model; ``on_start(target, running)`` hears of each refit
        started, and how many trials still run beside it."""
        self._slots = slots
        self._n_trials = n_trials
        self._best = best
        self._prepare = prepare
        self._on_start = on_start
        # A trial ended since the best was last asked for; at first, trials of a resumed sweep
        # may have ended before this run, and its refit can start beside the ones it reruns.
        self._ended = True
        self._wanted: RefitTarget | None = None
        self._refitting: _Refitting | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Ray pickles callbacks with the experiment state; a refit in training does not pickle,
        # and a restored sweep has an EarlyRefit of its own.
        return {}

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ended = True

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ended = True

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        if not getattr(self, "_slots", None):  # unpickled: nothing to do
            return
        if self._ended and slot_free(trials, n_trials=self._n_trials, slots=self._slots):
            self._ended = False
            self._wanted = self._best({trial.trial_id: trial.config for trial in trials})
            if self._refitting is not None and self._refitting.target != self._wanted:
                self._refitting.stop.set()
        current = self._refitting
        if self._wanted is None or (current is not None and (current.target == self._wanted or current.running)):
            return
        if current is not None:
            current.discard()
        self._on_start(self._wanted, sum(trial.status == "RUNNING" for trial in trials))
        self._refitting = _Refitting(self._wanted, self._prepare)

    def result_for(self, target: RefitTarget) -> tuple[RefitResult | None, Callable[[], None]]:
        """The refit of ``target`` if it was started early and ended well (waited for), and what
        deletes its files once published; else None (any other refit is stopped and deleted)."""
        current, self._refitting = self._refitting, None
        if current is None:
            return None, lambda: None
        if current.target != target:
            current.discard()
            return None, lambda: None
        result = current.outcome()
        if result is None:
            current.discard()
            return None, lambda: None
        return result, current.discard

    def close(self) -> None:
        """Stop and delete a refit still running (the sweep stopped)."""
        current, self._refitting = self._refitting, None
        if current is not None:
            current.discard()
