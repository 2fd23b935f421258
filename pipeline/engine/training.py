"""One fold's training engine: its model, optimizer and compiled epoch loop, fast.

Where the time goes at small batch sizes is fixed per-step cost, not arithmetic, so the engine
removes it: batches are index vectors gathered from device-resident tensors inside the compiled
step, a whole epoch runs as one execution (a loop inside one ``tf.function``, what Keras calls
``steps_per_execution`` = steps per epoch), there are no per-batch callbacks, the step is
XLA-compiled where the trial's plan says so, and several steps can be unrolled into one compiled
launch (``pipeline.plan`` decides both). A ``FoldExecutor`` trains a trial's engines one epoch at
a time: ``SequentialFolds`` here, one after another; ``pipeline.fused`` side by side in one
execution; ``pipeline.stacked`` stacked into one XLA program.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import keras
import numpy as np

from pipeline.folds import Fold
from pipeline.losses import TrainingLoss
from pipeline.resident import ResidentData
from pipeline.results import EVAL_STEP, NanEvent

METRIC_NAMES: tuple[str, ...] = ("loss", "accuracy")
EVAL_BATCH_SIZE = 2048


# Spec name of a clipping kind -> the Keras optimizer argument that applies it.
CLIPPING_ARGUMENTS: Mapping[str, str] = {"norm": "clipnorm", "value": "clipvalue", "global_norm": "global_clipnorm"}


@dataclass(frozen=True)
class TrainingParams:
    batch_size: int
    learning_rate: float
    optimizer: str
    clipping: str = "none"
    clip_threshold: float | None = None
    shuffle: bool = True


# The optimizers foldsweep makes itself (spec name -> Keras class and fixed arguments).
OPTIMIZERS: Mapping[str, tuple[type, Mapping[str, Any]]] = {
    "adam": (keras.optimizers.Adam, {}), "adamw": (keras.optimizers.AdamW, {}),
    "sgd": (keras.optimizers.SGD, {"momentum": 0.9}), "rmsprop": (keras.optimizers.RMSprop, {}),
}


@dataclass(frozen=True)
class OptimizerRecipe:
    """How to make a fold's optimizer: a Keras class and its configuration, gradient clipping
    included; ``source`` says whose it is: ``hypermodel`` (its own compile), ``spec`` (foldsweep's,
    named by the spec) or ``default``."""

    cls: type
    config: Mapping[str, Any]
    source: str

    def make(self, *, clipping: bool = True) -> keras.optimizers.Optimizer:
        """A fresh optimizer (every fold has its own state); without its clipping when the
        gradients are clipped before it (stacked folds clip each fold's slices themselves)."""
        config = dict(self.config)
        if not clipping:
            config.update({argument: None for argument in CLIPPING_ARGUMENTS.values()})
        return self.cls.from_config(config)

    @property
    def clipping(self) -> tuple[str, float | None]:
        """The clipping kind and threshold in the configuration (Keras allows one at a time)."""
        for kind, argument in CLIPPING_ARGUMENTS.items():
            if self.config.get(argument) is not None:
                return kind, self.config[argument]
        return "none", None

    @property
    def name(self) -> str:
        """The spec's name of the optimizer where it has one (adam, sgd...), else its class."""
        return next((name for name, (cls, _) in OPTIMIZERS.items() if cls is self.cls), self.cls.__name__)

    @property
    def learning_rate(self) -> float | str:
        """The learning rate in effect, as the optimizer holds it (float32: shown to 7 digits), or
        its schedule as a call (``ExponentialDecay(0.01, decay_steps=1000, decay_rate=0.9)``)."""
        rate = self.config.get("learning_rate")
        return float(f"{rate:.7g}") if isinstance(rate, (int, float)) else schedule_text(rate)


def schedule_text(schedule: Any) -> str:
    """A learning-rate schedule (object or its serialized config) as its class called with the
    arguments that differ from the class's defaults, the initial rate first and unnamed."""
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        cls, config = type(schedule), schedule.get_config()
    elif isinstance(schedule, dict) and "class_name" in schedule:
        cls = getattr(keras.optimizers.schedules, schedule["class_name"], None)
        config = schedule.get("config", {})
    else:
        return str(schedule)
    defaults = {} if cls is None else {name: parameter.default for name, parameter
                                       in inspect.signature(cls.__init__).parameters.items()}
    arguments = {key: value for key, value in config.items()
                 if key != "name" and not (key in defaults and defaults[key] == value)}
    first = next((key for key in arguments if key.startswith("initial_")), None)
    shown = [_short_number(arguments.pop(first))] if first else []
    shown += [f"{key}={_short_number(value)}" for key, value in arguments.items()]
    return f"{schedule['class_name'] if cls is None else cls.__name__}({', '.join(shown)})"


def _short_number(value: Any) -> str:
    return f"{value:.7g}" if isinstance(value, float) else repr(value) if isinstance(value, str) else str(value)


def optimizer_recipe(model: keras.Model, params: TrainingParams, *, spec_names: frozenset[str] = frozenset()
                     ) -> OptimizerRecipe:
    """A fold model's optimizer: the one its build compiled, if any, else foldsweep's. The
    spec's ``optimizer`` and ``learning_rate`` replace the compiled ones only where the spec's
    search space names them (``spec_names``); the spec's clipping applies to either."""
    compiled = getattr(model, "optimizer", None)
    if compiled is not None and "optimizer" not in spec_names:
        config = dict(compiled.get_config())
        if "learning_rate" in spec_names:
            config["learning_rate"] = params.learning_rate
        recipe = OptimizerRecipe(type(compiled), config, "hypermodel")
    else:
        if params.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {params.optimizer!r}")
        cls, fixed = OPTIMIZERS[params.optimizer]
        config = cls(learning_rate=params.learning_rate, **fixed).get_config()
        recipe = OptimizerRecipe(cls, config, "spec" if spec_names & {"optimizer", "learning_rate"} else "default")
    if params.clipping != "none":
        clip = {argument: None for argument in CLIPPING_ARGUMENTS.values()}
        clip[CLIPPING_ARGUMENTS[params.clipping]] = params.clip_threshold
        recipe = OptimizerRecipe(recipe.cls, {**recipe.config, **clip}, recipe.source)
    return recipe


def make_optimizer(params: TrainingParams) -> keras.optimizers.Optimizer:
    """foldsweep's own optimizer for ``params``, with gradient clipping through its own argument."""
    return optimizer_recipe(_UNCOMPILED, params).make()


class _Uncompiled:
    optimizer = None


_UNCOMPILED = _Uncompiled()


def epoch_order(train_indices: np.ndarray, *, seed: int, epoch: int) -> np.ndarray:
    """A fold's training order in one epoch: a permutation drawn from (fold seed, epoch), so any
    epoch can be replayed exactly, in a fresh process or after a restore."""
    return np.random.default_rng([seed, epoch]).permutation(train_indices)


def fold_seed(trial_seed: int, fold: int) -> int:
    """Each fold's initialisation and shuffling seed, independent of which trials ran before."""
    return int(np.random.SeedSequence([trial_seed, fold]).generate_state(1)[0])


@dataclass(frozen=True)
class EpochTally:
    """What one fold's training steps of an epoch add up to: summed loss over trained samples,
    the step that failed (-1 if none) and the last good step's loss and gradient norm."""

    loss_sum: float
    trained: int
    failed_at: int
    last_loss: float
    last_norm: float

    @classmethod
    def of(cls, outputs: Any) -> EpochTally:
        """The tally from what a compiled epoch loop returned."""
        loss_sum, trained, failed_at, last_loss, last_norm = outputs
        return cls(float(loss_sum), int(trained), int(failed_at), float(last_loss), float(last_norm))


def tally_step(tally: tuple[Any, ...], *, step: Any, loss: Any, norm: Any, healthy: Any, active: Any,
               samples: Any) -> tuple[Any, ...]:
    """The epoch tally after one training step (inside the compiled launch; per fold when the
    arguments carry a fold axis): a step that was active adds its loss and samples if healthy,
    else records where the fold failed."""
    import tensorflow as tf

    loss_sum, trained, failed_at, last_loss, last_norm = tally
    applied = healthy & active
    return (loss_sum + tf.where(applied, loss * tf.cast(samples, loss.dtype), 0.0),
            trained + tf.where(applied, tf.cast(samples, trained.dtype), 0),
            tf.where(active & ~healthy, step, failed_at),
            tf.where(applied, loss, last_loss),
            tf.where(applied, norm, last_norm))


class CallTimer:
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
                 fold: Fold, *, batch_size: int, seed: int, jit_compile: bool, loss: TrainingLoss = TrainingLoss(
                     keras.losses.sparse_categorical_crossentropy), eager: bool = False, steps_per_launch: int = 1,
                 shuffle: bool = True):
        import tensorflow as tf

        self.model = model
        self.optimizer = optimizer
        loss_of = loss
        self.batch_size = batch_size
        self.seed = seed
        self.jit_compile = jit_compile
        self.device = data.device
        self._train_indices = np.asarray(fold.train, dtype=np.int32)
        self._val_indices = np.asarray(fold.val, dtype=np.int32)
        self.train_timer = CallTimer()
        self.eval_timer = CallTimer()
        self.failure: NanEvent | None = None
        # The XLA-compiled launch (None when the step runs without XLA): each trace is a program.
        self.compiled_steps: Any = None
        optimizer.build(model.trainable_variables)
        features, labels = data.x, data.y
        self.shuffle = shuffle

        def train_step(indices, enabled):
            x = tf.gather(features, indices)
            y = tf.gather(labels, indices)
            with tf.GradientTape() as tape:
                predictions = model(x, training=True)
                loss = tf.reduce_mean(loss_of.per_sample(y, predictions))
                if model.losses:
                    loss = loss + tf.add_n(model.losses)
            gradients = tape.gradient(loss, model.trainable_variables)
            norm = tf.linalg.global_norm([g for g in gradients if g is not None])
            # A scalar test per step: a non-finite loss or gradient is never applied, so the fold
            # stops with the weights of its last good step.
            healthy = tf.math.is_finite(loss) & tf.math.is_finite(norm)
            if healthy & enabled:
                optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss, norm, healthy

        def train_steps(batches, first_step, tally):
            # One compiled launch: the steps of ``batches`` ([steps, batch], a static number of
            # steps, unrolled), each adding to the epoch's tally inside the launch. Once a step
            # fails, the steps after it in the launch apply nothing.
            for j in range(batches.shape[0]):
                active = tally[2] < 0
                loss, norm, healthy = train_step(batches[j], active)
                tally = tally_step(tally, step=first_step + j, loss=loss, norm=norm, healthy=healthy, active=active,
                                   samples=batches.shape[1])
            return tally

        def train_epoch(full_batches, remainder):
            # The whole epoch is one execution: a graph loop over the epoch's index batches,
            # steps_per_launch of them per compiled launch, left at the first step whose loss or
            # gradient is not finite. Full batches that do not fill a launch and the remainder
            # go one per launch.
            # Zeros, not NaN, for the last loss and norm, so that TensorFlow's numeric checking
            # (rerun --check-numerics) only ever stops at a value the model produced.
            tally = (tf.constant(0.0), tf.constant(0), tf.constant(-1), tf.constant(0.0), tf.constant(0.0))
            n_full = tf.shape(full_batches)[0]
            launched = n_full // steps_per_launch * steps_per_launch
            launches = tf.reshape(full_batches[:launched], [-1, steps_per_launch, batch_size])
            for launch in tf.range(tf.shape(launches)[0]):
                tally = steps(launches[launch], launch * steps_per_launch, tally)
                if failed(tally):
                    break
            for first in tf.range(launched, n_full):
                if failed(tally):
                    break
                tally = steps(full_batches[first][tf.newaxis], first, tally)
            if remainder.shape[0]:
                if not failed(tally):
                    tally = steps(remainder[tf.newaxis], n_full, tally)
            return tally

        def failed(tally):
            return tally[2] >= 0

        def evaluate_batch(indices):
            y = tf.gather(labels, indices)
            predictions = model(tf.gather(features, indices), training=False)
            return tf.reduce_sum(loss_of.per_sample(y, predictions)), tf.reduce_sum(loss_of.correct(y, predictions))

        if eager:
            steps, self._train_epoch, self._evaluate_batch = train_steps, train_epoch, evaluate_batch
        else:
            # Shapes are not relaxed: the unrolled step needs its number of steps statically
            # (it sees at most three: a launch, one batch, the remainder).
            steps = tf.function(train_steps, jit_compile=jit_compile)
            if jit_compile:
                self.compiled_steps = steps
            self._train_epoch = tf.function(train_epoch)
            self._evaluate_batch = tf.function(evaluate_batch, reduce_retracing=True)
        # The uncompiled epoch loop (its steps compiled), for ``pipeline.fused`` to run several
        # folds' loops in one execution.
        self.epoch_loop = train_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """This epoch's training order (the fold's own order when a hypermodel's fit asks for
        ``shuffle=False``)."""
        return epoch_order(self._train_indices, seed=self.seed, epoch=epoch) if self.shuffle else self._train_indices

    def epoch_batches(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """This epoch's index batches: the full ones as a [steps, batch_size] array, and the
        remainder (shorter than a batch, possibly empty)."""
        order = self.epoch_order(epoch)
        steps = len(order) // self.batch_size
        return order[: steps * self.batch_size].reshape(steps, self.batch_size), order[steps * self.batch_size:]

    @property
    def train_samples(self) -> int:
        return len(self._train_indices)

    def epoch_batch_tensors(self, epoch: int) -> tuple[Any, Any]:
        """This epoch's index batches as device tensors, the arguments of the epoch loop."""
        import tensorflow as tf

        # Index batches go to the device as one small int tensor per epoch; the features never
        # leave it. (A tf.data iterator consumed inside the compiled loop was measured at
        # ~15k samples/s whatever the batch size on the 2-core CPU; this reaches 37k-100k.)
        full, remainder = self.epoch_batches(epoch)
        with tf.device(self.device):
            return tf.constant(full), tf.constant(remainder)

    def train_epoch(self, epoch: int) -> float:
        started = time.perf_counter()
        tally = EpochTally.of(self._train_epoch(*self.epoch_batch_tensors(epoch)))
        self.train_timer.add(time.perf_counter() - started, self.train_samples)
        return self.close_epoch(epoch, tally)

    def close_epoch(self, epoch: int, tally: EpochTally) -> float:
        """The epoch's mean training loss; records where the fold failed if it did."""
        good = tally.trained > 0
        if tally.failed_at >= 0:
            self.failure = NanEvent(epoch=epoch + 1, step=tally.failed_at,
                                    last_finite_loss=tally.last_loss if good else math.nan,
                                    grad_norm=tally.last_norm if good else math.nan)
        return tally.loss_sum / tally.trained if good else math.nan

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


class FoldExecutor(Protocol):
    """Trains a trial's fold engines one epoch at a time, in one layout."""

    def train_epoch(self, epoch: int, live: tuple[int, ...]) -> dict[int, float]:
        """Train the engines at positions ``live`` one epoch; returns their mean training loss."""
        ...


class SequentialFolds:
    """The unfused layout: each fold's compiled epoch loop, one after another."""

    def __init__(self, engines: Sequence[FoldEngine]):
        self._engines = list(engines)

    def train_epoch(self, epoch: int, live: tuple[int, ...]) -> dict[int, float]:
        return {i: self._engines[i].train_epoch(epoch) for i in live}


def close_shared_epoch(engines: Sequence[FoldEngine], live: tuple[int, ...], epoch: int, seconds: float,
                       tallies: Sequence[EpochTally]) -> dict[int, float]:
    """Charge the live engines for an epoch trained together in ``seconds`` and close it with
    each one's tally; returns their mean training loss."""
    # The folds trained together: each is charged an equal share of the wall time, so that the
    # trial's rate (all samples over all fold seconds) is the rate the trial trained at.
    share = seconds / len(live)
    losses = {}
    for i, tally in zip(live, tallies):
        engine = engines[i]
        engine.train_timer.add(share, engine.train_samples)
        losses[i] = engine.close_epoch(epoch, tally)
    return losses
