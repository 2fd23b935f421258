"""The k fold models of one trial, trained in lockstep, one epoch at a time, as a plan says.

``build_trainer`` builds the fold models, asks ``pipeline.contract.plan`` how to run them and returns the
``FoldTrainer`` that executes that plan: each ``run_epoch`` trains every live fold one epoch
through the plan's executor (one after another, side by side, or stacked) and returns a typed
``EpochResult``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import keras
import numpy as np

from pipeline.base import compile_cache
from pipeline.base.accelerator import GpuIdentity, UnknownGpu, deterministic_ops, gpu_identity
from pipeline.base.compile_cache import CacheCounts, CompileCache, content_names
from pipeline.base.errors import ExperimentError
from pipeline.base.host_cpu import graph_vector_width
from pipeline.base.keras_private import compile_arguments
from pipeline.base.tensorflow_private import use_graph_optimizer
from pipeline.contract.account import TimeAccount
from pipeline.contract.plan import (
    RandomDraws,
    StackedConvolutions,
    TrialPlan,
    plan_differences,
    plan_trial,
    shared_variable_count,
)
from pipeline.contract.results import (
    COMPILE_S,
    EVAL_S,
    GAP_S,
    SETUP_S,
    TRAIN_S,
    EpochResult,
    FoldScores,
    FoldThroughput,
    NanEvent,
    NanReport,
    Throughput,
)
from pipeline.engine.fold_engine import CallTimer, FoldEngine, FoldExecutor, StoppedCall, fold_seed, probe_model
from pipeline.engine.profile import TRAIN_REGION, VALIDATION_REGION
from pipeline.engine.recipe import OptimizerRecipe, TrainingParams, TrainingRecipe, TrialConfig
from pipeline.engine.resident import ResidentData
from pipeline.engine.runtime import tf32_in_effect, threads_in_effect
from pipeline.engine.sequential import SequentialFolds
from pipeline.engine.side_by_side import SideBySideFolds
from pipeline.engine.xla_support import xla_blocker
from pipeline.inputs.folds import Fold
from pipeline.inputs.hypermodel import SHARED_LAYERS_RULE, build_model, output_units
from pipeline.inputs.losses import TrainingLoss, uncompiled_models_loss
from pipeline.inputs.scoring import compiles_named_accuracy, scored_metric_arguments


@dataclass
class EpochClock:
    """When a trainer's epochs ran, on ``time.perf_counter``: the first one's start, the last
    one's end, the seconds of training launches and of validation (compiling included), and the
    pauses between one epoch's validation and the next one's training."""

    first_began: float | None = None
    last_validated: float | None = None
    train_s: float = 0.0
    eval_s: float = 0.0
    gap_s: float = 0.0
    # The last epoch's: the pause before it (None for the first), its training and validation,
    # and its wall clock since the epoch before it was validated (None for the first).
    last_gap_s: float | None = None
    last_train_s: float = 0.0
    last_eval_s: float = 0.0
    last_wall_s: float | None = None

    def close_epoch(self, began: float, trained: float, validated: float) -> None:
        if self.last_validated is None:
            self.first_began = began
            self.last_gap_s = self.last_wall_s = None
        else:
            self.last_gap_s = began - self.last_validated
            self.last_wall_s = validated - self.last_validated
            self.gap_s += self.last_gap_s
        self.last_train_s, self.last_eval_s = trained - began, validated - trained
        self.train_s += self.last_train_s
        self.eval_s += self.last_eval_s
        self.last_validated = validated


class FoldTrainer:
    """The k fold models of one trial, trained in lockstep on device-resident data."""

    def __init__(
        self,
        models: Sequence[keras.Model],
        params: TrainingParams,
        *,
        data: ResidentData,
        folds: Sequence[Fold],
        plan: TrialPlan,
        recipe: TrainingRecipe,
        fold_ids: Sequence[int],
        optimizer: OptimizerRecipe,
        loss: TrainingLoss,
    ):
        self.params = params
        self.plan = plan
        self.optimizer = optimizer
        self.loss = loss
        self.train = recipe.train
        self.epoch = 0
        # The folds' numbers in the sweep: a rerun of one fold still reports split{k} as k.
        self.fold_ids = list(fold_ids)
        # The first fold's traced step serves the others where it is theirs; not where stacked
        # folds train through a step of their own, nor under numeric checking, whose finding
        # names the failing op's layer in the fold's own graph.
        shared = plan.layout != "stacked" and not recipe.choices.check_numerics
        self.engines: list[FoldEngine] = []
        for k, fold, model in zip(self.fold_ids, folds, models):
            first = self.engines[0].traced_step if self.engines and shared else None
            self.engines.append(
                FoldEngine(
                    model,
                    optimizer.make(model.trainable_variables),
                    data,
                    fold,
                    plan=plan,
                    recipe=recipe,
                    params=params,
                    loss=loss,
                    seed=fold_seed(recipe.train.seed, k),
                    template=first,
                )
            )
        # Which way each metric besides loss and accuracy improves ("" when unknown): what a fold
        # that went NaN counts as in the CV mean.
        self.directions = {scorer.name: scorer.direction or "" for scorer in self.engines[0].metrics.scorers()}
        self._executor = _executor(plan, self.engines, params, data=data, loss=loss, optimizer=optimizer)
        self._cache = _CacheUse.start(plan) if not recipe.choices.eager else None
        self.clock = EpochClock()

    @property
    def models(self) -> list[keras.Model]:
        return [engine.model for engine in self.engines]

    def model_with_trained_optimizer(self) -> keras.Model:
        """The first fold's model (the refit's one), compiled with the optimizer that trained it,
        in the state training left it (the step count a schedule reads, Adam's moments), as Keras'
        fit leaves a model: training it on goes on from there.

        Where that optimizer is the one the build compiled (the same class and settings), the
        build's own object gets the trained state. Where the spec replaced or changed it (its
        optimizer, learning rate or clipping), the model is compiled again with what its build
        compiled (loss, metrics, loss weights), around the trained optimizer. Where the build
        compiled nothing, it is compiled with what trained and scored it: the trained optimizer,
        the loss (``uncompiled_models_loss``), the accuracy and ``train.metrics``. Left as it is
        where its class compiles in a way of its own."""
        engine = self.engines[0]
        model, trained = engine.model, engine.optimizer
        compiled, arguments = getattr(model, "optimizer", None), compile_arguments(model)
        own_compile = type(model).compile is keras.Model.compile
        if compiled is None and arguments is None and own_compile:
            accuracy = [self.loss.accuracy_metric()] if self.loss.own_accuracy else []
            model.compile(
                optimizer=trained,
                loss=uncompiled_models_loss(self.loss, self.train),
                metrics=[*accuracy, *self.train.metrics],
            )
            return model
        if compiled is None or arguments is None:
            return model
        if _same_settings(compiled, trained):
            if not compiled.built:
                compiled.build(model.trainable_variables)
            pairs = list(zip(compiled.variables, trained.variables))
            if len(compiled.variables) == len(trained.variables) and all(a.shape == b.shape for a, b in pairs):
                for kept, value in pairs:
                    kept.assign(value)
                return model
        if own_compile:
            model.compile(**{**arguments, "optimizer": trained})
        return model

    def run_epoch(self) -> EpochResult:
        """Train every live fold one more epoch, then validate each."""
        if self._cache is None:
            return self._run_epoch()
        with content_names():
            result = self._run_epoch()
        self._cache.observe()
        return replace(result, throughput=self.throughput())

    def _run_epoch(self) -> EpochResult:
        from tensorflow.profiler.experimental import Trace

        # The regions mark a profiled epoch's trace (pipeline.engine.profile); unprofiled, each
        # costs a flag's test.
        began = time.perf_counter()
        live = tuple(i for i, engine in enumerate(self.engines) if engine.failure is None)
        with Trace(TRAIN_REGION):
            train_losses = self._executor.train_epoch(self.epoch, live) if live else {}
        trained = time.perf_counter()
        scores = []
        with Trace(VALIDATION_REGION):
            for i, engine in enumerate(self.engines):
                if i not in train_losses:  # frozen since it went NaN; the other folds train on
                    scores.append(FoldScores.frozen(engine.metrics.names, classifier=engine.own_accuracy))
                    continue
                val_loss, val_accuracy, others = engine.evaluate(self.epoch)
                if engine.failure is not None:
                    val_loss = math.nan
                    val_accuracy = None if val_accuracy is None else math.nan
                    others = {name: math.nan for name in others}
                scores.append(FoldScores(train_losses[i], val_loss, val_accuracy, others))
        self.clock.close_epoch(began, trained, time.perf_counter())
        self.epoch += 1
        failures = [(k, engine.failure) for k, engine in zip(self.fold_ids, self.engines) if engine.failure is not None]
        return EpochResult(
            epoch=self.epoch,
            fold_ids=tuple(self.fold_ids),
            folds=tuple(scores),
            throughput=self.throughput(),
            nan=NanReport.of(failures),
            directions=self.directions,
            epoch_gap_s=self.clock.last_gap_s,
        )

    def time_account(self, *, started: float, now: float) -> TimeAccount:
        """Where the wall clock from ``started`` (the trial's start in this process) to ``now``
        went (``pipeline.contract.results.TRIAL_PARTS``). Compiling is the throughput's
        ``compile_s``, taken out of the training and validation it happened in; before it can be
        told apart (one epoch), it is counted in them."""
        clock = self.clock
        compile_s = self.throughput().compile_s
        train_compile = eval_compile = 0.0
        if math.isfinite(compile_s):
            train_compile = sum(engine.train_timer.compile_s() for engine in self.engines)
            eval_compile = sum(_zero_if_nan(engine.eval_timer.compile_s()) for engine in self.engines)
        first = clock.first_began if clock.first_began is not None else now
        return TimeAccount.of(
            now - started,
            **{
                SETUP_S: first - started,
                COMPILE_S: train_compile + eval_compile,
                TRAIN_S: clock.train_s - train_compile,
                EVAL_S: clock.eval_s - eval_compile,
                GAP_S: clock.gap_s,
            },
        )

    def stopped_call(self) -> StoppedCall | None:
        """Where an error (TensorFlow's numeric checking) stopped the last ``run_epoch``: the fold
        engine it stopped mid-call, with the fold's number; None when it stopped none alone (folds
        trained side by side or stacked are one call, which numeric checking never makes)."""
        stopped = [
            (k, call) for k, engine in zip(self.fold_ids, self.engines) if (call := engine.stopped_call()) is not None
        ]
        return replace(stopped[0][1], fold=stopped[0][0]) if len(stopped) == 1 else None

    def throughput(self) -> Throughput:
        """Training and evaluation samples/s with compilation excluded, and compilation seconds,
        per fold and for the trial (all folds)."""
        return Throughput(
            train_samples_per_s=_combined_rate([engine.train_timer for engine in self.engines]),
            eval_samples_per_s=_combined_rate([engine.eval_timer for engine in self.engines]),
            compile_s=float(
                sum(
                    engine.train_timer.compile_s() + _zero_if_nan(engine.eval_timer.compile_s())
                    for engine in self.engines
                )
            ),
            folds=tuple(
                FoldThroughput(engine.train_timer.samples_per_s(), engine.train_timer.compile_s())
                for engine in self.engines
            ),
            cache_hits=self._cache.counts.hits if self._cache else None,
            cache_misses=self._cache.counts.compiled if self._cache else None,
        )

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
                    [failure.epoch, failure.step, failure.last_finite_loss, failure.grad_norm], dtype=np.float64
                )
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
                engine.failure = NanEvent(
                    epoch=int(epoch), step=int(step), last_finite_loss=float(loss), grad_norm=float(norm)
                )


def build_trainer(
    build_fn: Callable[[Any], keras.Model],
    config: Mapping[str, Any] | TrialConfig,
    recipe: TrainingRecipe,
    *,
    data: ResidentData,
    folds: Sequence[Fold],
    fold_ids: Sequence[int] | None = None,
    planned_epochs: int | None = None,
    replay: TrialPlan | None = None,
) -> FoldTrainer:
    """Build a trial's fold models for ``config`` (resolved by ``recipe.resolve``, or already),
    plan how to train them as ``recipe`` says, and the trainer that executes the plan. The one
    way a trial, a rerun and the refit are trained.

    With ``replay`` (a recorded plan, whose choices the recipe's then are), the recorded plan
    itself is executed when the new decision comes to the same execution. A model its build
    compiled keeps its optimizer and loss, with the training hyperparameters the spec's search
    space names in place of the compiled ones.
    """
    # Before anything of the trial is traced or run, the stacking check's forward passes too.
    use_graph_optimizer(light=recipe.choices.graph_optimizer == "light")
    trial = recipe.resolve(config)
    params, model_values = trial.params, trial.model_values
    seed = recipe.train.seed
    fold_ids = list(fold_ids) if fold_ids is not None else list(range(len(folds)))
    input_shape = tuple(data.x.shape[1:])
    models = []
    for k in fold_ids:
        # Every fold's model under the same layer names (conv1d, conv1d_1... afresh): the names
        # are in its traced step's graph, so the folds' steps are one program, compiled once.
        keras.backend.clear_session(free_memory=False)
        keras.utils.set_random_seed(fold_seed(seed, k))
        models.append(build_model(build_fn, model_values, input_shape=input_shape))
    shared = shared_variable_count(models, trainable=True)
    if shared:
        raise ExperimentError(
            f"experiment: the fold models build(hp) returns for {dict(model_values)} share {shared} trainable "
            f"variables: {SHARED_LAYERS_RULE}"
        )
    optimizer = recipe.optimizer(models[0], params)
    per_position = data.y.shape.rank > 1 and not data.y.dtype.is_floating
    loss = recipe.loss(
        models[0],
        units=output_units(models[0], input_shape),
        regression=data.y.dtype.is_floating,
        per_position=per_position,
        one_hot_labels=data.one_hot,
    )

    tf32 = tf32_in_effect(data.device)

    def stacking_blocker(jit_compile: bool, random_draws: RandomDraws, convolutions: StackedConvolutions) -> str | None:
        from pipeline.engine.stacked import stacking_blocker

        if recipe.train.class_weight is not None:
            return "train.class_weight (each fold's own weights) is not yet applied in the stacked step"
        if data.y.shape.rank > 1:
            return "targets with more than one value per sample (per position, or a vector) are not yet stacked"
        return stacking_blocker(
            models,
            data,
            [fold.train for fold in folds],
            batch_size=params.batch_size,
            jit_compile=jit_compile,
            random_draws=random_draws,
            optimizer=optimizer,
            convolutions=convolutions,
            tf32=tf32,
        )

    probe = probe_model(models[0], data, folds[0])
    plan = plan_trial(
        recipe.choices,
        models=models,
        threads=threads_in_effect(),
        device=data.device,
        batch_size=params.batch_size,
        train_sizes=[len(fold.train) for fold in folds],
        planned_epochs=planned_epochs or trial.epochs,
        stacking_blocker=stacking_blocker,
        xla_blocker=lambda random_draws: xla_blocker(models[0], input_shape, counter_draws=random_draws == "counter"),
        tf32=tf32,
        gpu=_gpu_identity(data.device),
        deterministic_ops=deterministic_ops(),
        keras_loss=loss.keras_own,
        loss_scale_factor=optimizer.loss_scale_factor,
        decay_exclusions=bool(optimizer.decay_excluded),
        compiled_clipping_cleared=optimizer.clipping_cleared,
        logits_thresholded_at_half=loss.logits_thresholded_at_half,
        validation_loss_terms=probe.loss_terms,
        validated_per_batch=probe.per_batch,
        compiled_accuracy=loss.own_accuracy and compiles_named_accuracy(models[0]),
        metric_rows=loss.one_hot
        and not loss.labels_one_hot
        and any(scored_metric_arguments(models[0], recipe.train.metrics, own_accuracy=loss.own_accuracy)),
        graph_vector_width=graph_vector_width(),
    )
    if replay is not None and plan.layout == replay.layout and not plan_differences(replay, plan):
        plan = replay
    return FoldTrainer(
        models,
        params,
        data=data,
        folds=folds,
        plan=plan,
        recipe=recipe,
        fold_ids=fold_ids,
        optimizer=optimizer,
        loss=loss,
    )


def _gpu_identity(device: str) -> GpuIdentity | None:
    """The GPU of ``device``, None on CPU or where it cannot be identified (a trial trains on
    regardless; its compile cache is off then, with the notice)."""
    if "GPU" not in device:
        return None
    try:
        return gpu_identity()
    except UnknownGpu:
        return None


def _executor(
    plan: TrialPlan,
    engines: Sequence[FoldEngine],
    params: TrainingParams,
    *,
    data: ResidentData,
    loss: TrainingLoss,
    optimizer: OptimizerRecipe,
) -> FoldExecutor:
    if plan.layout == "stacked":
        from pipeline.engine.stacked import StackedFolds

        return StackedFolds(
            engines,
            params,
            data=data,
            loss=loss,
            optimizer=optimizer,
            steps_per_launch=plan.steps_per_launch,
            stop_test=plan.stop_test,
            convolutions=plan.stacked_convolutions,
        )
    if plan.layout == "side_by_side":
        return SideBySideFolds(engines)
    return SequentialFolds(engines)


class _CacheUse:
    """A trial's use of the compile cache: the programs it loaded or compiled."""

    def __init__(self, cache: CompileCache):
        cache.refresh()
        self.cache = cache
        self.counts = CacheCounts()
        self._traced_before = compile_cache.traced_programs()
        self._before = {path.name for path in cache.process_directory.iterdir()}

    @classmethod
    def start(cls, plan: TrialPlan) -> _CacheUse | None:
        cache = compile_cache.active()
        if cache is None or not plan.jit_compile:
            return None
        return cls(cache)

    def observe(self) -> None:
        """After an epoch: count the distinct programs traced so far and the entries this trial
        wrote (each program it compiled), then share them with other processes."""
        self.counts.programs = compile_cache.programs_since(self._traced_before)
        written = {path.name for path in self.cache.process_directory.iterdir()} - self._before
        self.counts.compiled = len([name for name in written if name.endswith(compile_cache.ENTRY_SUFFIX)])
        self.cache.publish()


def _combined_rate(timers: Sequence[CallTimer]) -> float:
    """All folds together at their steady rates: total samples over total time."""
    samples = sum(timer.steady_samples or timer.first_samples for timer in timers)
    seconds = sum(timer.steady_s if timer.steady_samples else timer.first_s for timer in timers)
    return samples / seconds if seconds > 0 else float("nan")


def _zero_if_nan(value: float) -> float:
    return 0.0 if value != value else value


def _same_settings(compiled: keras.optimizers.Optimizer, trained: keras.optimizers.Optimizer) -> bool:
    """Whether ``trained`` was made as ``compiled`` is set, but for the loss_scale_factor each
    fold's optimizer leaves out (``OptimizerRecipe.make``). Both configs can be written: validate
    refuses an optimizer whose config cannot be (``optimizer_config``)."""
    return type(compiled) is type(trained) and trained.get_config() == {
        **compiled.get_config(),
        "loss_scale_factor": None,
    }
