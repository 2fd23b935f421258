"""The k fold models of one trial, trained in lockstep, one epoch at a time.

Each call to ``FoldTrainer.run_epoch`` trains every fold model for one epoch and returns the
epoch's results in scikit-learn's vocabulary (``split{k}_val_<metric>``, ``mean_val_<metric>``,
``std_val_<metric>``), the same keys Ray Tune, MLflow and ``cv_results.csv`` use. The folds train
fused (``pipeline.fused``) or each in its own compiled loop (``pipeline.training``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, Mapping, Sequence

import keras
import numpy as np

from pipeline.folds import Fold
from pipeline.fused import (FusedFolds, FusedLayout, arrange, compute_threads, decide_fusion, shared_variable_count,
                            wants_stacking)
from pipeline.hypermodel import build_model
from pipeline.resident import ResidentData
from pipeline.spec import AutoSwitch
from pipeline.training import (CallTimer, FoldEngine, NanEvent, TrainingParams, decide_steps_per_launch, fold_seed,
                               has_random_layers, make_optimizer, use_xla)

# What a fold that went NaN counts as in a trial's CV mean and std: the worst score, finite, so
# that no NaN reaches a searcher or scheduler (split{k} values stay NaN in the record).
NAN_FOLD_SCORES: Mapping[str, float] = {"val_accuracy": 0.0, "val_loss": 1e6, "train_loss": 1e6}


def cv_summary(per_fold: Sequence[Mapping[str, float]], fold_ids: Sequence[int] | None = None) -> dict[str, float]:
    """Per-fold results -> split{k}_<key>, mean_<key>, std_<key> (population std, as sklearn).

    A non-finite fold value stays as it is in split{k}_<key> and counts as the worst score
    (``NAN_FOLD_SCORES``) in the mean and std, which therefore stay finite.
    """
    summary: dict[str, float] = {}
    for key in per_fold[0]:
        values = np.array([fold[key] for fold in per_fold], dtype=np.float64)
        for k, value in zip(fold_ids if fold_ids is not None else range(len(values)), values):
            summary[f"split{k}_{key}"] = float(value)
        scored = np.where(np.isfinite(values), values, NAN_FOLD_SCORES.get(key, np.nan))
        summary[f"mean_{key}"] = float(scored.mean())
        summary[f"std_{key}"] = float(scored.std())
    return summary


class FoldTrainer:
    """The k fold models of one trial, trained in lockstep on device-resident data."""

    def __init__(
        self,
        build_fn: Callable[[Any], keras.Model],
        model_values: Mapping[str, Any],
        params: TrainingParams,
        *,
        data: ResidentData,
        folds: Sequence[Fold],
        seed: int,
        from_logits: bool = False,
        jit_compile: AutoSwitch = "auto",
        eager: bool = False,
        fold_ids: Sequence[int] | None = None,
        fused: AutoSwitch = "auto",
        steps_per_launch: int | Literal["auto"] = "auto",
        planned_epochs: int = 1,
        check_numerics: bool = False,
        fused_layout: FusedLayout = "auto",
    ):
        self.params = params
        self.epoch = 0
        # The folds' numbers in the sweep: a rerun of one fold still reports split{k} as k.
        self.fold_ids = list(fold_ids) if fold_ids is not None else list(range(len(folds)))
        self.engines: list[FoldEngine] = []
        models = []
        for k in self.fold_ids:
            keras.utils.set_random_seed(fold_seed(seed, k))
            models.append(build_model(build_fn, model_values))
        self.jit_compile = use_xla(jit_compile, batch_size=params.batch_size, device=data.device,
                                   stochastic=has_random_layers(models[0]))
        planned_steps = planned_epochs * min(len(fold.train) for fold in folds) // params.batch_size
        self.steps_per_launch = decide_steps_per_launch(steps_per_launch, jit_compile=self.jit_compile and not eager,
                                                        batch_size=params.batch_size, planned_steps=planned_steps)
        for k, fold, model in zip(self.fold_ids, folds, models):
            self.engines.append(FoldEngine(
                model, make_optimizer(params), data, fold, batch_size=params.batch_size,
                seed=fold_seed(seed, k), jit_compile=self.jit_compile, from_logits=from_logits, eager=eager,
                steps_per_launch=self.steps_per_launch,
            ))
        fusion = decide_fusion(fused, n_folds=len(models), eager=eager, check_numerics=check_numerics,
                               shared_variables=shared_variable_count(models))
        threads = compute_threads()
        blocker, stacked = None, False
        if fusion.enabled and wants_stacking(fused_layout, compute_threads=threads, device=data.device,
                                             batch_size=params.batch_size):
            from pipeline.stacked import stacking_blocker

            blocker = stacking_blocker(models, data, [fold.train for fold in folds], batch_size=params.batch_size,
                                       jit_compile=self.jit_compile)
            stacked = blocker is None
        self.fusion = arrange(fusion, stacked=stacked, compute_threads=threads, batch_size=params.batch_size,
                              blocker=blocker)
        self._fused: Any = None
        if self.fusion.stacked:
            from pipeline.stacked import StackedFolds

            self._fused = StackedFolds(self.engines, params, data=data, from_logits=from_logits,
                                       steps_per_launch=self.steps_per_launch)
        elif self.fusion.enabled:
            self._fused = FusedFolds(self.engines)

    @property
    def models(self) -> list[keras.Model]:
        return [engine.model for engine in self.engines]

    def run_epoch(self) -> dict[str, float]:
        """Train every fold one more epoch, then validate each; returns the CV summary and
        throughput so far."""
        train_losses = self._train_live_folds()
        per_fold = []
        for i, engine in enumerate(self.engines):
            if i not in train_losses:  # frozen since it went NaN; the other folds train on
                per_fold.append({"train_loss": math.nan, "val_loss": math.nan, "val_accuracy": math.nan})
                continue
            val_loss, val_accuracy = engine.evaluate(self.epoch)
            if engine.failure is not None:
                val_loss = val_accuracy = math.nan
            per_fold.append({"train_loss": train_losses[i], "val_loss": val_loss, "val_accuracy": val_accuracy})
        self.epoch += 1
        return {"epoch": self.epoch, **cv_summary(per_fold, self.fold_ids), **self.throughput(),
                **self.nan_report()}

    def _train_live_folds(self) -> dict[int, float]:
        live = tuple(i for i, engine in enumerate(self.engines) if engine.failure is None)
        if self._fused is not None and len(live) > 1:
            return self._fused.train_epoch(self.epoch, live)
        return {i: self.engines[i].train_epoch(self.epoch) for i in live}

    def nan_report(self) -> dict[str, float | int]:
        """How many folds went NaN, and where the first of them (by epoch, then fold) did."""
        failed = [(engine.failure, k) for k, engine in zip(self.fold_ids, self.engines) if engine.failure is not None]
        if not failed:
            return {"nan_failures": 0}
        first, fold = min(failed, key=lambda pair: (pair[0].epoch, pair[1]))
        return {"nan_failures": len(failed), "nan_fold": fold, "nan_epoch": first.epoch, "nan_step": first.step,
                "nan_last_finite_loss": first.last_finite_loss, "nan_grad_norm": first.grad_norm}

    def throughput(self) -> dict[str, float]:
        """Training and evaluation samples/s with compilation excluded, and compilation seconds,
        per fold (``split{k}_...``) and for the trial (all folds)."""
        result: dict[str, float] = {}
        for k, engine in zip(self.fold_ids, self.engines):
            result[f"split{k}_train_samples_per_s"] = engine.train_timer.samples_per_s()
            result[f"split{k}_compile_s"] = engine.train_timer.compile_s()
        result["train_samples_per_s"] = _combined_rate([engine.train_timer for engine in self.engines])
        result["eval_samples_per_s"] = _combined_rate([engine.eval_timer for engine in self.engines])
        result["compile_s"] = float(sum(engine.train_timer.compile_s() + _zero_if_nan(engine.eval_timer.compile_s())
                                        for engine in self.engines))
        return result

    def state(self) -> dict[str, np.ndarray]:
        """Variables (weights and random-generator state), optimizer state and epoch of every
        fold model, as plain arrays."""
        arrays = {"epoch": np.array(self.epoch)}
        for k, model in enumerate(self.models):
            for i, variable in enumerate(model.variables):
                arrays[f"fold{k}/weight{i}"] = np.asarray(variable)
            for i, variable in enumerate(self.engines[k].optimizer.variables):
                arrays[f"fold{k}/optimizer{i}"] = np.asarray(variable)
            failure = self.engines[k].failure
            if failure is not None:
                arrays[f"fold{k}/failure"] = np.array(
                    [failure.epoch, failure.step, failure.last_finite_loss, failure.grad_norm], dtype=np.float64)
        return arrays

    def load_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore what ``state`` returned; the models must have been built from the same config."""
        self.epoch = int(arrays["epoch"])
        for k, engine in enumerate(self.engines):
            for i, variable in enumerate(engine.model.variables):
                variable.assign(arrays[f"fold{k}/weight{i}"])
            for i, variable in enumerate(engine.optimizer.variables):
                variable.assign(arrays[f"fold{k}/optimizer{i}"])
            if f"fold{k}/failure" in arrays:
                epoch, step, loss, norm = arrays[f"fold{k}/failure"]
                engine.failure = NanEvent(epoch=int(epoch), step=int(step), last_finite_loss=float(loss),
                                          grad_norm=float(norm))


def _combined_rate(timers: Sequence[CallTimer]) -> float:
    """All folds together at their steady rates: total samples over total time."""
    samples = sum(timer.steady_samples or timer.first_samples for timer in timers)
    seconds = sum(timer.steady_s if timer.steady_samples else timer.first_s for timer in timers)
    return samples / seconds if seconds > 0 else float("nan")


def _zero_if_nan(value: float) -> float:
    return 0.0 if value != value else value
