"""Train the k fold models of one trial in lockstep, one epoch at a time, fast.

Each call to ``FoldTrainer.run_epoch`` trains every fold model for one epoch and returns the
epoch's results in scikit-learn's vocabulary (``split{k}_val_<metric>``, ``mean_val_<metric>``,
``std_val_<metric>``), the same keys Ray Tune, MLflow and ``cv_results.csv`` use.

Where the time goes at small batch sizes is fixed per-step cost, not arithmetic, so the engine
removes it: batches are index vectors gathered from device-resident tensors inside the compiled
step, a whole epoch runs as one execution (a loop inside one ``tf.function``, what Keras calls
``steps_per_execution`` = steps per epoch), there are no per-batch callbacks, and the step is
XLA-compiled where that is faster (see ``use_xla``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

import keras
import numpy as np

from pipeline.folds import Fold
from pipeline.hypermodel import build_model
from pipeline.resident import ResidentData

METRIC_NAMES: tuple[str, ...] = ("loss", "accuracy")
EVAL_BATCH_SIZE = 2048
# On CPU, XLA wins big while per-step overhead dominates (bs 8: 3-4x over the same loop
# without it) and stops paying around bs 256-512, where it was measured equal or up to 25%
# slower depending on the model (`python -m benchmarks.cv_throughput --variants
# engine-xla,engine-noxla`); above this batch size the step runs without XLA. Random layers
# (Dropout, GaussianNoise, ...) turn it around: their random-number ops under XLA on CPU made
# the MNIST-1D CNN's step 4-5x slower (7.4k vs 41k samples/s at bs 16, one thread).
XLA_MAX_BATCH_ON_CPU = 256
JitChoice = Literal["auto", "on", "off"]


# Spec name of a clipping kind -> the Keras optimizer argument that applies it.
CLIPPING_ARGUMENTS: Mapping[str, str] = {"norm": "clipnorm", "value": "clipvalue", "global_norm": "global_clipnorm"}


@dataclass(frozen=True)
class TrainingParams:
    batch_size: int
    learning_rate: float
    optimizer: str
    clipping: str = "none"
    clip_threshold: float | None = None


def make_optimizer(params: TrainingParams) -> keras.optimizers.Optimizer:
    """The Keras optimizer, with gradient clipping through its own clipping argument."""
    kwargs: dict[str, Any] = {"learning_rate": params.learning_rate}
    if params.clipping != "none":
        kwargs[CLIPPING_ARGUMENTS[params.clipping]] = params.clip_threshold
    if params.optimizer == "adam":
        return keras.optimizers.Adam(**kwargs)
    if params.optimizer == "adamw":
        return keras.optimizers.AdamW(**kwargs)
    if params.optimizer == "sgd":
        return keras.optimizers.SGD(momentum=0.9, **kwargs)
    if params.optimizer == "rmsprop":
        return keras.optimizers.RMSprop(**kwargs)
    raise ValueError(f"unknown optimizer {params.optimizer!r}")


def use_xla(choice: JitChoice, *, batch_size: int, device: str, stochastic: bool = False) -> bool:
    """Whether to XLA-compile the train step: forced by the spec, else by device, batch size and
    whether the model draws random numbers in training."""
    if choice != "auto":
        return choice == "on"
    if "GPU" in device:
        return True
    return batch_size <= XLA_MAX_BATCH_ON_CPU and not stochastic


def has_random_layers(model: keras.Model) -> bool:
    """Layers that draw random numbers when training carry a Keras seed generator."""
    return any(hasattr(layer, "seed_generator") for layer in model._flatten_layers())


def fold_seed(trial_seed: int, fold: int) -> int:
    """Each fold's initialisation and shuffling seed, independent of which trials ran before."""
    return int(np.random.SeedSequence([trial_seed, fold]).generate_state(1)[0])


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



EVAL_STEP = -1  # a NanEvent step: found by validation, not by a training step
# What a fold that went NaN counts as in a trial's CV mean and std: the worst score, finite, so
# that no NaN reaches a searcher or scheduler (split{k} values stay NaN in the record).
NAN_FOLD_SCORES: Mapping[str, float] = {"val_accuracy": 0.0, "val_loss": 1e6, "train_loss": 1e6}


@dataclass(frozen=True)
class NanEvent:
    """Where a fold first went non-finite: epoch (1-based), step within that epoch (0-based;
    EVAL_STEP when validation found it), the last finite training loss and the gradient global
    norm of that last good step."""

    epoch: int
    step: int
    last_finite_loss: float
    grad_norm: float


class _Timer:
    """Execution times of one compiled function; the first call carries tracing and compilation."""

    def __init__(self) -> None:
        self.first_s = 0.0
        self.first_samples = 0
        self.steady_s = 0.0
        self.steady_samples = 0

    def add(self, seconds: float, samples: int) -> None:
        if self.first_samples == 0:
            self.first_s, self.first_samples = seconds, samples
        else:
            self.steady_s += seconds
            self.steady_samples += samples

    def samples_per_s(self) -> float:
        """Steady-state rate once a compiled call has been timed, else the first call's rate."""
        if self.steady_samples:
            return self.steady_samples / self.steady_s
        return self.first_samples / self.first_s if self.first_s else float("nan")

    def compile_s(self) -> float:
        """First call's time beyond what its samples cost at the steady rate (NaN until known)."""
        if not self.steady_samples:
            return float("nan")
        return max(0.0, self.first_s - self.first_samples / self.samples_per_s())


class FoldEngine:
    """One fold's model, optimizer and compiled epoch loop over device-resident data."""

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer, data: ResidentData,
                 fold: Fold, *, batch_size: int, seed: int, jit_compile: bool, from_logits: bool,
                 eager: bool = False):
        import tensorflow as tf

        self.model = model
        self.optimizer = optimizer
        self.batch_size = batch_size
        self.seed = seed
        self.jit_compile = jit_compile
        self.device = data.device
        self._train_indices = np.asarray(fold.train, dtype=np.int32)
        self._val_indices = np.asarray(fold.val, dtype=np.int32)
        self.train_timer = _Timer()
        self.eval_timer = _Timer()
        self.failure: NanEvent | None = None
        optimizer.build(model.trainable_variables)
        features, labels = data.x, data.y
        mean_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits)
        summed_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits, reduction="sum")

        def train_step(indices):
            x = tf.gather(features, indices)
            y = tf.gather(labels, indices)
            with tf.GradientTape() as tape:
                predictions = model(x, training=True)
                loss = mean_loss(y, predictions)
                if model.losses:
                    loss = loss + tf.add_n(model.losses)
            gradients = tape.gradient(loss, model.trainable_variables)
            norm = tf.linalg.global_norm([g for g in gradients if g is not None])
            # A scalar test per step: a non-finite loss or gradient is never applied, so the fold
            # stops with the weights of its last good step.
            healthy = tf.math.is_finite(loss) & tf.math.is_finite(norm)
            if healthy:
                optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss, norm, healthy

        def train_epoch(full_batches, remainder):
            # The whole epoch is one execution: a graph loop over the epoch's index batches,
            # left at the first step whose loss or gradient is not finite.
            loss_sum = tf.constant(0.0)
            trained = tf.constant(0)
            failed_at = tf.constant(-1)
            # Zeros, not NaN, so that TensorFlow's numeric checking (rerun --check-numerics) only
            # ever stops at a value the model produced.
            last_loss = tf.constant(0.0)
            last_norm = tf.constant(0.0)
            for k in tf.range(tf.shape(full_batches)[0]):
                loss, norm, healthy = step(full_batches[k])
                if not healthy:
                    failed_at = k
                    break
                loss_sum += loss * batch_size
                trained += batch_size
                last_loss, last_norm = loss, norm
            if remainder.shape[0]:
                if failed_at < 0:
                    loss, norm, healthy = step(remainder)
                    if healthy:
                        loss_sum += loss * remainder.shape[0]
                        trained += remainder.shape[0]
                        last_loss, last_norm = loss, norm
                    else:
                        failed_at = tf.shape(full_batches)[0]
            return loss_sum / tf.cast(tf.maximum(trained, 1), tf.float32), failed_at, trained, last_loss, last_norm

        def evaluate_batch(indices):
            y = tf.gather(labels, indices)
            predictions = model(tf.gather(features, indices), training=False)
            correct = tf.reduce_sum(tf.cast(tf.argmax(predictions, -1, output_type=tf.int32) == y, tf.float32))
            return summed_loss(y, predictions), correct

        if eager:
            step, self._train_epoch, self._evaluate_batch = train_step, train_epoch, evaluate_batch
        else:
            step = tf.function(train_step, jit_compile=jit_compile, reduce_retracing=True)
            self._train_epoch = tf.function(train_epoch)
            self._evaluate_batch = tf.function(evaluate_batch, reduce_retracing=True)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """This epoch's training order: a permutation drawn from (fold seed, epoch), so any epoch
        can be replayed exactly, in a fresh process or after a restore."""
        return np.random.default_rng([self.seed, epoch]).permutation(self._train_indices)

    def train_epoch(self, epoch: int) -> float:
        import tensorflow as tf

        # Index batches go to the device as one small int tensor per epoch; the features never
        # leave it. (A tf.data iterator consumed inside the compiled loop was measured at
        # ~15k samples/s whatever the batch size on the 2-core CPU; this reaches 37k-100k.)
        order = self.epoch_order(epoch)
        steps = len(order) // self.batch_size
        with tf.device(self.device):
            full = tf.constant(order[: steps * self.batch_size].reshape(steps, self.batch_size))
            remainder = tf.constant(order[steps * self.batch_size:])
        started = time.perf_counter()
        loss, failed_at, trained, last_loss, last_norm = self._train_epoch(full, remainder)
        self.train_timer.add(time.perf_counter() - started, len(order))
        if int(failed_at) >= 0:
            good = int(trained) > 0
            self.failure = NanEvent(epoch=epoch + 1, step=int(failed_at),
                                    last_finite_loss=float(last_loss) if good else math.nan,
                                    grad_norm=float(last_norm) if good else math.nan)
            return float(loss) if good else math.nan
        return float(loss)

    def evaluate(self, epoch: int) -> tuple[float, float]:
        import tensorflow as tf

        started = time.perf_counter()
        loss_sum = correct = 0.0
        for begin in range(0, len(self._val_indices), EVAL_BATCH_SIZE):
            with tf.device(self.device):
                indices = tf.constant(self._val_indices[begin:begin + EVAL_BATCH_SIZE])
            batch_loss, batch_correct = self._evaluate_batch(indices)
            loss_sum += float(batch_loss)
            correct += float(batch_correct)
        self.eval_timer.add(time.perf_counter() - started, len(self._val_indices))
        loss, accuracy = loss_sum / len(self._val_indices), correct / len(self._val_indices)
        if not math.isfinite(loss) and self.failure is None:
            self.failure = NanEvent(epoch=epoch + 1, step=EVAL_STEP, last_finite_loss=float("nan"),
                                    grad_norm=float("nan"))
        return loss, accuracy


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
        jit_compile: JitChoice = "auto",
        eager: bool = False,
        fold_ids: Sequence[int] | None = None,
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
        for k, fold, model in zip(self.fold_ids, folds, models):
            self.engines.append(FoldEngine(
                model, make_optimizer(params), data, fold, batch_size=params.batch_size,
                seed=fold_seed(seed, k), jit_compile=self.jit_compile, from_logits=from_logits, eager=eager,
            ))

    @property
    def models(self) -> list[keras.Model]:
        return [engine.model for engine in self.engines]

    def run_epoch(self) -> dict[str, float]:
        """Train every fold one more epoch, then validate each; returns the CV summary and
        throughput so far."""
        per_fold = []
        for engine in self.engines:
            if engine.failure is not None:  # frozen since it went NaN; the other folds train on
                per_fold.append({"train_loss": math.nan, "val_loss": math.nan, "val_accuracy": math.nan})
                continue
            train_loss = engine.train_epoch(self.epoch)
            val_loss, val_accuracy = engine.evaluate(self.epoch)
            if engine.failure is not None:
                val_loss = val_accuracy = math.nan
            per_fold.append({"train_loss": train_loss, "val_loss": val_loss, "val_accuracy": val_accuracy})
        self.epoch += 1
        return {"epoch": self.epoch, **cv_summary(per_fold, self.fold_ids), **self.throughput(),
                **self.nan_report()}

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


def _combined_rate(timers: Sequence[_Timer]) -> float:
    """All folds together at their steady rates: total samples over total time."""
    samples = sum(timer.steady_samples or timer.first_samples for timer in timers)
    seconds = sum(timer.steady_s if timer.steady_samples else timer.first_s for timer in timers)
    return samples / seconds if seconds > 0 else float("nan")


def _zero_if_nan(value: float) -> float:
    return 0.0 if value != value else value
