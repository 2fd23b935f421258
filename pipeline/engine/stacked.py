"""Folds stacked: the k fold models' weights stacked along a leading fold axis and trained by one
XLA program per step, as horizontally fused training arrays (HFTA) do.

Why: at small batches a CPU step costs mostly a fixed price per compiled kernel, not arithmetic
(the MNIST-1D CNN's step runs ~120 kernels; 234 us at batch 2 against 308 us at batch 8, one
thread). Stacked, each kernel runs once for all k folds: 3 folds on one core trained 1.4x faster
than one fold after another. Side-by-side loops (``pipeline.engine.side_by_side``) do better once a trial
has a core per fold loop, so ``pipeline.contract.plan`` stacks for trials with one compute thread, or a GPU.

The researcher's ``build(hp)`` model is not rewritten: its graph is walked (``Functional``'s own
walk, into nested models too: a keras.applications backbone, a Sequential of augmentation
layers) with each layer that has trainable weights swapped for its registered stacked form
(``pipeline.engine.stacked_layers``: each fold's kernels, scales, tables, batch statistics and
moving averages), and every other layer called as it is, in training mode, on the folds'
samples merged into one batch, which is exact for per-sample layers (pooling, flatten,
activations). Frozen layers are called as they are too: their weights, the same in every fold,
are held once for all folds. Random layers draw foldsweep's numbers (``pipeline.engine.draws``)
from each fold's own generator state. Each fold's loss gets its own weight regularization and
activity regularization, as ``model.losses`` gives a fold model's.
A stacked forward pass is checked against every fold model's own (outputs, moving statistics,
generator states and loss terms) before it is used. The folds stay independent: each has its own
slice of every variable and of the optimizer's state, its loss, gradient norm and clipping are its
own, and a fold whose step is not finite keeps its slices as they were (the folds' steps are
masked, not skipped).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import keras
import numpy as np

from pipeline.base.keras_private import (
    counter_drawn,
    flatten_layers,
    holds_seed_generator,
    layer_graph,
    run_through_graph,
    seed_generator_of,
)
from pipeline.contract.plan import RandomDraws, StackedConvolutions, StopTest
from pipeline.engine import draws
from pipeline.engine.compiled_loop import EpochTally, compiled_launch, launch_loop, tally_step
from pipeline.engine.fold_engine import FoldEngine, close_shared_epoch, traced_once
from pipeline.engine.recipe import OptimizerRecipe, TrainingParams
from pipeline.engine.resident import ResidentData, step_labels
from pipeline.engine.stacked_layers import (
    Folds,
    broadcast_over_folds,
    layer_blocker,
    per_fold_sample_weights,
    split_folds,
    stacked_entry,
    state_variables,
)
from pipeline.inputs.losses import TrainingLoss
from pipeline.inputs.spec import CLIPPING_ARGUMENTS, NO_CLIPPING

# Activity regularizers that add up over samples, a zero sample adding nothing, so that a fold's
# penalty over its batch padded with zeros is its penalty over its own samples.
ADDITIVE_REGULARIZERS = (keras.regularizers.L1, keras.regularizers.L2, keras.regularizers.L1L2)
# Optimizers whose update of a weight depends on that weight's own gradient and state only, so
# that one optimizer over the stacked weights updates each fold's slice as the fold's own would
# (Adafactor, say, factors its state over a weight's axes, the fold axis included).
ELEMENTWISE_OPTIMIZERS = (
    keras.optimizers.Adam,
    keras.optimizers.AdamW,
    keras.optimizers.SGD,
    keras.optimizers.RMSprop,
    keras.optimizers.Nadam,
    keras.optimizers.Adamax,
    keras.optimizers.Adagrad,
    keras.optimizers.Lion,
)
# The stacked forward pass must give each fold model's own outputs up to float rounding
# (its convolutions are patch products or grouped convolutions, not the fold model's kernels).
FORWARD_CHECK_RTOL, FORWARD_CHECK_ATOL = 1e-4, 1e-5
# Under TF32 (a GPU's default on Ampere and newer) a product rounds its inputs to 10 mantissa bits
# (a relative 2^-11 = 4.9e-4 each), so two forms of one layer differ by about 1e-3 relative per
# layer, past float32's tolerance, and stacking would quietly fall back. What the check is for (a
# fold's samples or weights mixed with another's, a layer's form wrong) changes outputs by their
# own order of magnitude, which this tolerance still refuses.
FORWARD_CHECK_TF32_RTOL, FORWARD_CHECK_TF32_ATOL = 1e-2, 1e-3


def forward_tolerance(tf32: bool) -> tuple[float, float]:
    """(rtol, atol) of the stacked forward check on a device computing in TF32 or not."""
    return (FORWARD_CHECK_TF32_RTOL, FORWARD_CHECK_TF32_ATOL) if tf32 else (FORWARD_CHECK_RTOL, FORWARD_CHECK_ATOL)


def model_blocker(model: keras.Model, *, random_draws: RandomDraws = "none") -> str | None:
    """Why this model has no stacked form, or None. Nested models (a keras.applications backbone,
    a Sequential of augmentation layers) are walked into; a layer with trainable weights needs a
    registered stacked form (``pipeline.engine.stacked_layers``), a frozen one is held once."""
    layers = flatten_layers(model, include_self=False)
    random = [layer for layer in layers if holds_seed_generator(layer)]
    if random and random_draws != "counter":
        undrawn = next((layer for layer in random if not counter_drawn(layer)), None)
        if undrawn is None:
            return "its random layers draw from Keras' generator (the recorded plan), which has no per-fold form"
        return (
            f"layer {undrawn.name!r} ({type(undrawn).__name__}) draws from Keras' generator, which has no per-fold form"
        )
    for layer in random:
        if (getattr(layer, "noise_shape", None) or [None])[0] is not None:
            return f"layer {layer.name!r} has a noise_shape that fixes the batch axis"
        if isinstance(layer, keras.layers.RandomCrop):
            return f"layer {layer.name!r} (RandomCrop) draws one crop for the whole batch, which has no per-fold form"
    if model.dtype_policy.name != "float32" or any(layer.dtype_policy.name != "float32" for layer in layers):
        return "the model computes in another dtype than float32 (a mixed precision policy)"
    if layer_graph(model) is None:
        return "the model has no layer graph (a subclassed model, or a Sequential without an Input)"
    for layer in layers:
        if isinstance(layer, keras.Model):
            if layer_graph(layer) is None:
                return f"nested model {layer.name!r} has no layer graph (a subclassed model)"
            continue
        if isinstance(layer, keras.layers.Masking):
            return f"masking layer {layer.name!r}: masks are not carried through the stacked layers"
        regularizer = layer.activity_regularizer
        if regularizer is not None and type(regularizer) not in ADDITIVE_REGULARIZERS:
            return (
                f"layer {layer.name!r} has an activity_regularizer ({type(regularizer).__name__}) not known to add "
                "up over samples"
            )
        if not layer.trainable_variables and not state_variables(layer):
            continue  # weightless, or frozen: called as it is
        blocker = layer_blocker(layer)
        if blocker:
            return blocker
        if any(variable.constraint is not None for variable in layer.trainable_variables):
            return f"layer {layer.name!r} has a weight constraint"
        if getattr(layer, "lora_enabled", False):
            return f"layer {layer.name!r} has LoRA enabled"
        held = [variable for variable in layer.non_trainable_variables if not _is_state(layer, variable)]
        if held:
            return (
                f"layer {layer.name!r} ({type(layer).__name__}) has non-trainable weights its stacked form does "
                f"not update ({held[0].path})"
            )
    return None


def _is_state(layer: Any, variable: Any) -> bool:
    """Whether a non-trainable variable is state the stacked forms update per fold: a registered
    form's state (a trainable BatchNormalization's moving statistics), a drawn random layer's
    generator state."""
    if any(variable is state for state in state_variables(layer)):
        return True
    return counter_drawn(layer) and variable is seed_generator_of(layer).state


def _owners(model: keras.Model) -> dict[int, Any]:
    """Each of the model's variables (by id) and the innermost layer that holds it."""
    owners: dict[int, Any] = {}
    for layer in flatten_layers(model, include_self=False):
        if isinstance(layer, keras.Model):
            continue
        for variable in layer.variables:
            owners.setdefault(id(variable), layer)
    return owners


def stacked_state_variables(model: keras.Model) -> list[Any]:
    """The model's non-trainable variables that are state a stacked form updates per fold, in the
    model's order."""
    owners = _owners(model)
    return [
        variable
        for variable in model.non_trainable_variables
        if id(variable) in owners and _is_state(owners[id(variable)], variable)
    ]


def held_once_variables(model: keras.Model) -> list[Any]:
    """The model's non-trainable variables that are not per-fold state: frozen weights (a frozen
    backbone's, a frozen BatchNormalization's statistics) and constants (a Normalization layer's
    mean and variance), which stacked folds read from the template model, once for every fold."""
    state = {id(variable) for variable in stacked_state_variables(model)}
    return [variable for variable in model.non_trainable_variables if id(variable) not in state]


def held_once_blocker(models: Sequence[keras.Model]) -> str | None:
    """Why the fold models' frozen weights cannot be held once for every fold: they differ between
    the folds (each fold's model drew its own), or None."""
    for variables in zip(*(held_once_variables(model) for model in models)):
        first = np.asarray(variables[0])
        if any(not np.array_equal(first, np.asarray(variable)) for variable in variables[1:]):
            return (
                f"frozen weights {variables[0].path} differ between the folds (each fold's model draws its own; "
                "weights loaded from a file are held once)"
            )
    return None


def steps_blocker(folds_train_sizes: Sequence[int], batch_size: int) -> str | None:
    """Stacked folds step in lockstep: every fold needs as many steps per epoch."""
    steps = sorted({math.ceil(n / batch_size) for n in folds_train_sizes})
    if len(steps) > 1:
        return f"folds take {steps[0]} to {steps[-1]} steps per epoch at batch {batch_size}"
    return None


def stacking_blocker(
    models: Sequence[keras.Model],
    data: ResidentData,
    train_folds: Sequence[np.ndarray],
    *,
    batch_size: int,
    jit_compile: bool,
    optimizer: OptimizerRecipe,
    random_draws: RandomDraws = "none",
    convolutions: StackedConvolutions = "patches",
    tf32: bool = False,
) -> str | None:
    """Why these fold models cannot train stacked, or None (their stacked forward pass checked
    in the form the plan would train, to the device's tolerance)."""
    import tensorflow as tf

    if not jit_compile:
        return "the step runs without XLA"
    if optimizer.cls not in ELEMENTWISE_OPTIMIZERS:
        return f"the {optimizer.cls.__name__} optimizer is not known to update each weight on its own"
    accumulated = optimizer.config.get("gradient_accumulation_steps")
    if accumulated and optimizer.clipping[0] != NO_CLIPPING:
        # Keras clips the mean of the accumulated gradients as it applies them; the stacked step
        # clips each fold's gradient before the optimizer sees it, which is each step's.
        return (
            f"the optimizer clips ({CLIPPING_ARGUMENTS[optimizer.clipping[0]]}) the gradients it accumulates over "
            f"{accumulated} steps (gradient_accumulation_steps), which stacked folds would clip step by step"
        )
    blocker = (
        model_blocker(models[0], random_draws=random_draws)
        or held_once_blocker(models)
        or steps_blocker([len(train) for train in train_folds], batch_size)
    )
    if blocker:
        return blocker
    rows = min(batch_size, *(len(train) for train in train_folds))
    samples = tf.gather(data.x, np.concatenate([train[:rows] for train in train_folds]).astype(np.int32))
    return forward_mismatch(models, samples, convolutions=convolutions, tf32=tf32)


class StackedForm:
    """The template model's forward pass for k folds at once, in training mode: its layer graph
    run on the folds' batches merged fold-major ([k * b, ...]) with ``values``, which maps each
    of the template's variables (by id) to its stacked form with a leading fold axis: a tensor or
    variable for trainable weights, a variable for state (moving statistics, generator states),
    which the pass updates as each fold's own layers would. Nested models are run through their
    own graphs the same way; layers without trainable weights are called as they are."""

    def __init__(
        self,
        template: keras.Model,
        values: Mapping[int, Any],
        n_folds: int,
        *,
        convolutions: StackedConvolutions = "patches",
    ):
        self._template = template
        self._values = values
        self._n_folds = n_folds
        self._convolutions = convolutions
        generators = [
            seed_generator_of(layer) for layer in flatten_layers(template, include_self=False) if counter_drawn(layer)
        ]
        self._random_states = {
            id(generator): values[id(generator.state)] for generator in generators if generator is not None
        }

    def __call__(self, x: Any, sample_weights: Any) -> tuple[Any, Any]:
        """(outputs, each fold's loss terms [k], or None when the model adds none) for the merged
        batch ``x``; ``sample_weights`` [k, b] are 0 where a fold's batch is padded."""
        import tensorflow as tf

        penalties: list[Any] = []
        folds = Folds(self._n_folds, lambda variable: self._values[id(variable)], sample_weights, self._convolutions)

        def run_graph(model, inputs):
            outputs = run_through_graph(layer_graph(model), inputs, stacked_form)
            return outputs[0] if isinstance(outputs, (list, tuple)) and len(outputs) == 1 else outputs

        def stacked_form(layer):
            if isinstance(layer, keras.Model):  # a nested model: its own graph, walked the same way
                call = lambda inputs, **_: run_graph(layer, inputs)  # noqa: E731
            elif isinstance(layer, keras.layers.Layer) and (layer.trainable_variables or state_variables(layer)):
                entry = stacked_entry(layer)
                if entry is None:  # stacking_blocker refuses a model with such a layer before it is stacked
                    raise TypeError(layer_blocker(layer))
                form = entry.form
                call = lambda inputs, **_: form(layer, folds, inputs)  # noqa: E731
            elif isinstance(layer, keras.layers.Layer):  # as Functional.call(training=True) calls it
                call = lambda *args, **kwargs: layer(*args, **{**kwargs, "training": True})  # noqa: E731
            else:  # an operation of the graph (keras.ops on symbolic tensors)
                return layer
            if layer.activity_regularizer is None:
                return call

            def regularized(*args, **kwargs):
                outputs = call(*args, **kwargs)
                penalties.append(_activity_penalty(layer.activity_regularizer, outputs, sample_weights, self._n_folds))
                return outputs

            return regularized

        random_numbers = (
            draws.counter_draws(self._random_states, under_xla=True)
            if self._random_states
            else contextlib.nullcontext()
        )
        with random_numbers:
            outputs = run_graph(self._template, x)
        for variable in self._template.trainable_variables:
            if variable.regularizer is not None:
                stacked = folds.weights(variable)
                penalties.append(tf.stack([variable.regularizer(stacked[k]) for k in range(self._n_folds)]))
        return outputs, (tf.add_n(penalties) if penalties else None)


def _activity_penalty(regularizer, outputs, sample_weights, n_folds):
    """[k]: each fold's activity regularization of a layer's ``outputs``, over its own samples
    and divided by their number, as Keras' Layer.__call__ adds it."""
    import tensorflow as tf

    x = split_folds(outputs, n_folds)
    if sample_weights is None:
        return tf.stack([regularizer(x[k]) / x.shape[1] for k in range(n_folds)])
    kept = x * per_fold_sample_weights(sample_weights, x.shape.rank)
    counts = tf.reduce_sum(sample_weights, axis=1)
    return tf.stack([tf.math.divide_no_nan(regularizer(kept[k]), counts[k]) for k in range(n_folds)])


def over_folds(per_fold: Sequence[Any]) -> np.ndarray:
    """One variable's per-fold values, stacked along a leading fold axis."""
    return np.stack([np.asarray(value) for value in per_fold])


def stacked_weights(models: Sequence[keras.Model]) -> list[np.ndarray]:
    """The models' trainable variables, each stacked along a leading fold axis."""
    return [over_folds(weights) for weights in zip(*(model.trainable_variables for model in models))]


def forward_mismatch(
    models: Sequence[keras.Model], samples: Any, *, convolutions: StackedConvolutions = "patches", tf32: bool = False
) -> str | None:
    """What of the stacked forward pass differs from each fold model's own in training (outputs,
    updated moving statistics and generator states, loss terms), beyond the tolerance of a
    device computing in TF32 or not (``forward_tolerance``), or None. ``samples`` are the folds'
    batches merged fold-major, different per fold so that mixing across folds shows. The weights
    held once for every fold must not move in training, in either pass. The fold models' state
    is as it was afterwards."""
    import tensorflow as tf

    template, n_folds = models[0], len(models)
    states = [stacked_state_variables(model) for model in models]
    held = [held_once_variables(model) for model in models]
    before = [[np.asarray(variable) for variable in fold] for fold in states]
    held_before = [[np.asarray(variable) for variable in fold] for fold in held]
    values: dict[int, Any] = {
        id(variable): tf.constant(weights)
        for variable, weights in zip(template.trainable_variables, stacked_weights(models))
    }
    stacked_states = [tf.Variable(over_folds(per_fold)) for per_fold in zip(*before)]
    values.update({id(variable): stacked for variable, stacked in zip(states[0], stacked_states)})
    batches = np.split(np.asarray(samples), n_folds)
    outputs, penalties = StackedForm(template, values, n_folds, convolutions=convolutions)(
        samples, tf.ones([n_folds, len(batches[0])])
    )
    drawn = any(counter_drawn(layer) for layer in flatten_layers(template))
    random_numbers = functools.partial(draws.counter_draws, under_xla=True) if drawn else contextlib.nullcontext
    own, own_penalties = [], []
    moved = [[np.asarray(variable) for variable in held[0]]]  # the template's, after the stacked pass
    try:
        for model, batch in zip(models, batches):
            with random_numbers():
                own.append(np.asarray(model(batch, training=True)))
            own_penalties.append(float(sum(np.asarray(loss) for loss in model.losses)))
        after = [[np.asarray(variable) for variable in fold] for fold in states]
        moved += [[np.asarray(variable) for variable in fold] for fold in held]
    finally:
        for fold, values_before in [*zip(states, before), *zip(held, held_before)]:
            for variable, value in zip(fold, values_before):
                variable.assign(value)
    for fold_after, fold_before in zip(moved, [held_before[0], *held_before]):
        for variable, value, value_before in zip(held[0], fold_after, fold_before):
            if not np.array_equal(value, value_before):
                return (
                    f"{variable.path} is not trainable and not state a stacked form updates, yet moves in "
                    "training: it cannot be held once for every fold"
                )

    rtol, atol = forward_tolerance(tf32)

    def close(a: Any, b: Any) -> bool:
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and np.allclose(a, b, rtol=rtol, atol=atol)

    if not close(outputs, np.concatenate(own)):
        return "the stacked forward pass does not reproduce the model's outputs"
    for i, (stacked, variable) in enumerate(zip(stacked_states, states[0])):
        if not close(stacked, over_folds([fold[i] for fold in after])):
            return f"the stacked forward pass does not reproduce the model's {variable.path}"
    if not close(np.zeros(n_folds) if penalties is None else penalties, own_penalties):
        return "the stacked forward pass does not reproduce the model's loss terms (model.losses)"
    return None


def forward_matches(models: Sequence[keras.Model], samples: Any, **form: Any) -> bool:
    """Whether the stacked forward pass gives what each fold model gives (``forward_mismatch``)."""
    return forward_mismatch(models, samples, **form) is None


def fold_square_sums(gradient):
    """[k]: each fold's sum of squares of one stacked gradient."""
    import tensorflow as tf

    return tf.reduce_sum(tf.square(gradient), axis=list(range(1, gradient.shape.rank)))


def fold_norms(gradients):
    """[k]: each fold's global norm over all its gradient slices."""
    import tensorflow as tf

    return tf.sqrt(tf.add_n([fold_square_sums(gradient) for gradient in gradients]))


def clip_per_fold(kind: str, threshold: float | None) -> Callable[[list[Any], Any], list[Any]]:
    """Keras' clipping by the optimizer argument of clipping ``kind`` (``CLIPPING_ARGUMENTS``), on
    each fold's slices: ``clipnorm`` per variable slice, ``global_clipnorm`` over one fold's slices
    (``fold_norms``, which the step has already computed for its health check), ``clipvalue``
    elementwise."""
    import tensorflow as tf

    if kind == NO_CLIPPING:
        return lambda gradients, _: gradients
    if threshold is None:
        raise ValueError(f"clipping {kind!r} needs a threshold")

    def by_norm(gradients, _):  # keras BaseOptimizer._clip_by_norm, per fold
        clipped = []
        for gradient in gradients:
            l2sum = broadcast_over_folds(fold_square_sums(gradient), gradient.shape.rank)
            positive = l2sum > 0
            l2norm = tf.where(positive, tf.sqrt(tf.where(positive, l2sum, tf.ones_like(l2sum))), l2sum)
            clipped.append(gradient * threshold / tf.maximum(l2norm, threshold))
        return clipped

    def by_global_norm(gradients, norm):  # keras clip_by_global_norm, per fold
        scale = threshold * tf.minimum(1.0 / norm, 1.0 / threshold) + (norm - norm)
        return [g * broadcast_over_folds(scale, g.shape.rank) for g in gradients]

    def by_value(gradients, _):
        return [tf.clip_by_value(g, -threshold, threshold) for g in gradients]

    return {"clipnorm": by_norm, "global_clipnorm": by_global_norm, "clipvalue": by_value}[CLIPPING_ARGUMENTS[kind]]


class StackedFolds:
    """Trains fold engines one epoch at a time, stacked into one XLA program per step.

    The fold engines keep the truth between epochs (their models are evaluated, checkpointed and
    restored): an epoch starts by stacking their variables and optimizer state and ends by
    writing each fold's slices back.
    """

    def __init__(
        self,
        engines: Sequence[FoldEngine],
        params: TrainingParams,
        *,
        data: ResidentData,
        loss: TrainingLoss,
        optimizer: OptimizerRecipe,
        steps_per_launch: int,
        stop_test: StopTest = "per_launch",
        convolutions: StackedConvolutions = "patches",
    ):
        import tensorflow as tf

        self._engines = list(engines)
        self._batch_size = params.batch_size
        self._index_dtype = data.index_dtype
        n_folds = len(engines)
        stacked = _stacked_state(engines, optimizer)
        self._pairs = stacked.pairs
        self._copy_functions: dict[tuple[int, ...], tuple[Any, Any]] = {}
        steps = compiled_launch(
            _stacked_steps(
                engines[0].model, stacked, loss=loss, clipping=optimizer.clipping, data=data, convolutions=convolutions
            ),
            jit_compile=True,
        )

        def stopped(tally, live):
            return tf.reduce_all(~live | tally.failed)

        def train_epoch(indices, weights, live):
            # indices, weights: [steps, k, batch]; the epoch's steps, steps_per_launch per launch.
            return launch_loop(
                lambda *arguments: steps(*arguments[:2], live, *arguments[2:]),
                (indices, weights),
                EpochTally.start(n_folds),
                steps_per_launch=steps_per_launch,
                stopped=None if stop_test == "per_epoch" else lambda tally: stopped(tally, live),
            )

        self._train_epoch = tf.function(train_epoch, autograph=False)

    def epoch_batches(self, epoch: int, live: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """[steps, k, batch] index and weight arrays: each live fold's batches of this epoch,
        its short last batch padded with weight 0; folds not live get weight 0 throughout."""
        per_fold: dict[int, list[np.ndarray]] = {}
        for i in live:
            full, remainder = self._engines[i].epoch_batches(epoch)
            per_fold[i] = [*full, remainder] if len(remainder) else list(full)
        n_steps = len(next(iter(per_fold.values())))
        indices = np.zeros((n_steps, len(self._engines), self._batch_size), dtype=self._index_dtype)
        weights = np.zeros(indices.shape, dtype=np.float32)
        for i, batches in per_fold.items():
            for step, batch in enumerate(batches):
                indices[step, i, : len(batch)] = batch
                weights[step, i, : len(batch)] = 1.0
        return indices, weights

    def train_epoch(self, epoch: int, live: tuple[int, ...]) -> dict[int, float]:
        """Train the engines at positions ``live`` one epoch; returns their mean training loss."""
        import tensorflow as tf

        indices, weights = self.epoch_batches(epoch, live)
        mask = np.isin(np.arange(len(self._engines)), live)
        with tf.device(self._engines[0].device):
            arguments = tf.constant(indices), tf.constant(weights), tf.constant(mask)
        # The copies into and out of the stacked variables are the epoch's training, and tracing
        # them in the first epoch is its compiling.
        started = time.perf_counter()
        self._load(live)
        tally = EpochTally(*(np.asarray(value) for value in self._train_epoch(*arguments)))
        self._store(live)
        seconds = time.perf_counter() - started
        return close_shared_epoch(self._engines, live, epoch, seconds, [tally.numbers(i) for i in live])

    def _load(self, live: tuple[int, ...]) -> None:
        """Stack the engines' weights, layer state and optimizer state (they may have been restored)."""
        self._copies(live)[0]()

    def _store(self, live: tuple[int, ...]) -> None:
        self._copies(live)[1]()

    def _copies(self, live: tuple[int, ...]) -> tuple[Callable[[], None], Callable[[], None]]:
        """(load, store) for the live folds as compiled copies between the fold engines' variables
        and the stacked ones: device to device, so that on a GPU the weights and optimizer state
        never visit the host between epochs (the same values as a copy through the host)."""
        import tensorflow as tf

        if live not in self._copy_functions:

            def load():
                for stacked, per_fold in self._pairs:
                    if stacked.shape.rank:
                        stacked.assign(tf.stack([variable.value for variable in per_fold]))
                    else:  # the step count and learning rate, the same in every fold that trains on
                        stacked.assign(per_fold[live[0]].value)

            def store():
                for stacked, per_fold in self._pairs:
                    slices = tf.unstack(stacked.value) if stacked.shape.rank else [stacked.value] * len(per_fold)
                    for i in live:
                        per_fold[i].assign(slices[i])

            self._copy_functions[live] = (tf.function(load, autograph=False), tf.function(store, autograph=False))
        return self._copy_functions[live]


class _Stacked(NamedTuple):
    """The stacked folds' variables: ``weights`` (the template's trainable variables with a fold
    axis), ``states`` (its layer state, ``stacked_state_variables``), one optimizer over the
    weights, and every stacked variable paired with the folds' own (``pairs``)."""

    weights: list[Any]
    states: list[Any]
    optimizer: Any
    pairs: list[tuple[Any, tuple[Any, ...]]]

    def values(self, template: keras.Model) -> dict[int, Any]:
        """``StackedForm``'s values: each template variable's stacked variable."""
        own = [*template.trainable_variables, *(stacked_state_variables(template))]
        return {id(variable): stacked for variable, stacked in zip(own, [*self.weights, *self.states])}


def _stacked_state(engines: Sequence[FoldEngine], recipe: OptimizerRecipe) -> _Stacked:
    """The stacked variables of the engines' models and optimizers: weights and layer state always
    carry the fold axis, optimizer state too except the shared scalars (step count, learning rate)."""
    n_folds = len(engines)
    models = [engine.model for engine in engines]
    variables = [
        keras.Variable(weights, name=variable.name)
        for weights, variable in zip(stacked_weights(models), models[0].trainable_variables)
    ]
    per_fold_states = list(zip(*(stacked_state_variables(model) for model in models)))
    states = [
        keras.Variable(over_folds(per_fold), dtype=per_fold[0].dtype, trainable=False, name=per_fold[0].name)
        for per_fold in per_fold_states
    ]
    # Clipping is done per fold before the optimizer sees the gradients; everything the
    # optimizers below do is elementwise, so each fold's slice is updated on its own.
    optimizer = recipe.make(variables, clipping=False)
    optimizer.build(variables)
    optimizer_pairs = list(zip(optimizer.variables, zip(*(engine.optimizer.variables for engine in engines))))
    for stacked, per_fold in optimizer_pairs:
        if tuple(stacked.shape) not in (tuple(per_fold[0].shape), (n_folds, *per_fold[0].shape)):
            raise ValueError(
                f"optimizer variable {stacked.name!r}: stacked shape {tuple(stacked.shape)} "
                f"does not match a fold's {tuple(per_fold[0].shape)}"
            )
    pairs = [
        *zip(variables, zip(*(model.trainable_variables for model in models))),
        *zip(states, per_fold_states),
        *optimizer_pairs,
    ]
    return _Stacked(variables, states, optimizer, pairs)


def _stacked_steps(
    template: keras.Model,
    stacked: _Stacked,
    *,
    loss: TrainingLoss,
    clipping: tuple[str, float | None],
    data: ResidentData,
    convolutions: StackedConvolutions = "patches",
) -> Any:
    """The stacked folds' training launch, uncompiled: ``train_steps(indices, weights, live,
    first_step, tally)`` runs the unrolled steps of every fold at once ([steps, k, batch]) and
    returns the per-fold tally after them."""
    import tensorflow as tf

    variables, optimizer = stacked.weights, stacked.optimizer
    n_folds = int(variables[0].shape[0])
    form = StackedForm(template, stacked.values(template), n_folds, convolutions=convolutions)
    # What a fold that does not apply a step keeps: its slices of the weights and of the
    # optimizer's per-variable state (the step count and learning rate are shared scalars).
    states = {id(state) for state in stacked.states}
    kept = [variable for variable, _ in stacked.pairs if variable.shape.rank and id(variable) not in states]
    clip = clip_per_fold(*clipping)
    features, labels = data.x, data.y

    def train_step(indices, weights, active):
        # indices, weights: [k, batch]; a weight of 0 pads a fold's short last batch.
        x = tf.gather(features, tf.reshape(indices, [-1]))
        # the folds' batches, one after another (int64 class labels on a GPU: ``step_labels``)
        y = step_labels(tf.reshape(tf.gather(labels, indices), [-1, *labels.shape[1:]]))
        counts = tf.reduce_sum(weights, axis=1)
        # Layer state (moving statistics, generator states) moves in the forward pass of every
        # fold that trains, as a fold model's own does whether its step is then applied or not.
        states_before = [tf.identity(state.value) for state in stacked.states]
        with tf.GradientTape() as tape:
            predictions, penalties = form(x, weights)
            per_sample = tf.reshape(loss.per_sample(y, predictions), [n_folds, -1])
            losses = tf.reduce_sum(per_sample * weights, axis=1) / tf.maximum(counts, 1.0)
            if penalties is not None:  # each fold's model.losses
                losses = losses + penalties
            total = tf.reduce_sum(losses)  # each fold's slices get its own loss' gradient only
        gradients = tape.gradient(total, variables)
        norms = fold_norms(gradients)
        healthy = tf.math.is_finite(losses) & tf.math.is_finite(norms)
        applied = healthy & active
        previous = [tf.identity(v.value) for v in kept]
        optimizer.apply_gradients(zip(clip(gradients, norms), variables))
        # A fold not applying this step keeps its slices of the weights and optimizer state.
        for variable, before in zip(kept, previous):
            variable.assign(tf.where(broadcast_over_folds(applied, variable.shape.rank), variable.value, before))
        for state, before in zip(stacked.states, states_before):
            state.assign(tf.where(broadcast_over_folds(active, state.shape.rank), state.value, before))
        return losses, norms, healthy, counts

    step = traced_once(train_step, eager=False, compiled=True)

    def train_steps(indices, weights, live, first_step, tally):
        for j in range(indices.shape[0]):
            active = live & tally.intact
            losses, norms, healthy, counts = step(indices[j], weights[j], active)
            tally = tally_step(
                tally, step=first_step + j, loss=losses, norm=norms, healthy=healthy, active=active, samples=counts
            )
        return tally

    return train_steps
