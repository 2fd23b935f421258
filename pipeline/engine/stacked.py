"""Folds stacked: the k fold models' weights stacked along a leading fold axis and trained by one
XLA program per step, as horizontally fused training arrays (HFTA) do.

Why: at small batches a CPU step costs mostly a fixed price per compiled kernel, not arithmetic
(the MNIST-1D CNN's step runs ~120 kernels; 234 us at batch 2 against 308 us at batch 8, one
thread). Stacked, each kernel runs once for all k folds: 3 folds on one core trained 1.4x faster
than one fold after another (#9). Side-by-side loops (``pipeline.engine.side_by_side``) do better once a trial
has a core per fold loop, so ``pipeline.contract.plan`` stacks for trials with one compute thread, or a GPU.

The researcher's ``build(hp)`` model is not rewritten: its graph is walked (``Functional``'s own
walk) with each weighted layer swapped for its stacked form, and every other layer called as it
is, in training mode, on the folds' samples merged into one batch, which is exact for per-sample
layers (pooling, flatten, activations). The stacked forms: Dense, Conv1D and Conv2D (each fold's
kernel and bias), LayerNormalization and Embedding (each fold's scale, offset or table),
BatchNormalization (each fold's batch statistics, over its own samples only, and its own moving
averages, with the layer's momentum and epsilon). Random layers draw foldsweep's numbers
(``pipeline.engine.draws``) from each fold's own generator state. Each fold's loss gets its own
weight regularization and activity regularization, as ``model.losses`` gives a fold model's.
A stacked forward pass is checked against every fold model's own (outputs, moving statistics,
generator states and loss terms) before it is used. The folds stay independent: each has its own
slice of every variable and of the optimizer's state, its loss, gradient norm and clipping are its
own, and a fold whose step is not finite keeps its slices as they were (the folds' steps are
masked, not skipped).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import keras
import numpy as np

from pipeline.base.private_hooks import counter_drawn, holds_seed_generator
from pipeline.contract.plan import RandomDraws, StackedConvolutions, StopTest
from pipeline.engine import draws
from pipeline.engine.fold_engine import (
    EpochTally,
    FoldEngine,
    close_shared_epoch,
    compiled_launch,
    launch_loop,
    tally_step,
    traced_once,
)
from pipeline.engine.recipe import OptimizerRecipe, TrainingParams
from pipeline.engine.resident import ResidentData, step_labels
from pipeline.inputs.losses import TrainingLoss
from pipeline.inputs.spec import CLIPPING_ARGUMENTS, NO_CLIPPING

STACKED_LAYERS = (
    keras.layers.Dense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.Embedding,
)
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
    """Why this model has no stacked form, or None."""
    layers = list(model._flatten_layers(include_self=False, recursive=True))
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
    if model.dtype_policy.name != "float32" or any(layer.dtype_policy.name != "float32" for layer in layers):
        return "the model computes in another dtype than float32 (a mixed precision policy)"
    if _graph(model) is None:
        return "the model has no layer graph (a subclassed model, or a Sequential without an Input)"
    for layer in layers:
        if isinstance(layer, keras.Model):
            return f"nested model {layer.name!r}"
        if isinstance(layer, keras.layers.Masking):
            return f"masking layer {layer.name!r}: masks are not carried through the stacked layers"
        regularizer = layer.activity_regularizer
        if regularizer is not None and type(regularizer) not in ADDITIVE_REGULARIZERS:
            return (
                f"layer {layer.name!r} has an activity_regularizer ({type(regularizer).__name__}) not known to add "
                "up over samples"
            )
        if not layer.weights:
            continue
        if not isinstance(layer, STACKED_LAYERS):
            return f"{type(layer).__name__} layers have no stacked form"
        if any(variable.constraint is not None for variable in layer.trainable_variables):
            return f"layer {layer.name!r} has a weight constraint"
        if getattr(layer, "lora_enabled", False):
            return f"layer {layer.name!r} has LoRA enabled"
        if isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D)):
            if layer.groups != 1 or layer.data_format != "channels_last" or layer.padding not in ("same", "valid"):
                return (
                    f"convolution {layer.name!r} (groups {layer.groups}, {layer.data_format}, padding "
                    f"{layer.padding!r}) has no stacked form"
                )
        if isinstance(layer, keras.layers.BatchNormalization) and (layer.renorm or layer.synchronized):
            return f"batch normalization {layer.name!r} with {'renorm' if layer.renorm else 'synchronized'}=True"
        if isinstance(layer, keras.layers.Embedding) and layer.mask_zero:
            return f"embedding {layer.name!r} with mask_zero=True: masks are not carried through the stacked layers"
        if isinstance(layer, keras.layers.LayerNormalization) and 0 in _sample_axes(layer.axis, len(layer.input.shape)):
            return f"layer normalization {layer.name!r} over the batch axis"
    if stacked_state_variables(model) is None:
        named = [
            layer.name
            for layer in layers
            if any(not _is_state(layer, variable) for variable in layer.non_trainable_variables)
        ]
        return (
            f"{len(model.non_trainable_variables)} non-trainable variables (layer state"
            f"{' of ' + ', '.join(repr(name) for name in named[:3]) if named else ''})"
        )
    return None


def _is_state(layer: Any, variable: Any) -> bool:
    """Whether a non-trainable variable is state the stacked forms update per fold: a trainable
    BatchNormalization's moving statistics, a drawn random layer's generator state."""
    if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
        return variable is layer.moving_mean or variable is layer.moving_variance
    return counter_drawn(layer) and variable is layer.seed_generator.state


def stacked_state_variables(model: keras.Model) -> list[Any] | None:
    """The model's non-trainable variables when each is state a stacked form updates per fold
    (in the model's order), else None."""
    owners = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        for variable in layer.non_trainable_variables:
            owners.setdefault(id(variable), layer)
    variables = list(model.non_trainable_variables)
    if any(id(variable) not in owners or not _is_state(owners[id(variable)], variable) for variable in variables):
        return None
    return variables


def _sample_axes(axis: Any, rank: int) -> list[int]:
    """A layer's axis argument as axes of its [batch, ...] input of ``rank``, non-negative."""
    return sorted(a % rank for a in (axis if isinstance(axis, (list, tuple)) else [axis]))


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
    blocker = model_blocker(models[0], random_draws=random_draws) or steps_blocker(
        [len(train) for train in train_folds], batch_size
    )
    if blocker:
        return blocker
    rows = min(batch_size, *(len(train) for train in train_folds))
    samples = tf.gather(data.x, np.concatenate([train[:rows] for train in train_folds]).astype(np.int32))
    return forward_mismatch(models, samples, convolutions=convolutions, tf32=tf32)


def _graph(model: keras.Model) -> Any:
    """The Functional graph a model runs through, if it has one."""
    if isinstance(model, keras.Sequential):
        return model._functional
    if hasattr(model, "_run_through_graph") and hasattr(model, "_nodes_by_depth"):
        return model
    return None


class StackedForm:
    """The template model's forward pass for k folds at once, in training mode: its layer graph
    run on the folds' batches merged fold-major ([k * b, ...]) with ``values``, which maps each
    of the template's variables (by id) to its stacked form with a leading fold axis: a tensor or
    variable for trainable weights, a variable for state (moving statistics, generator states),
    which the pass updates as each fold's own layers would."""

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
        self._convolution = _grouped_convolution if convolutions == "grouped" else _convolution
        generators = [
            getattr(layer, "seed_generator", None)
            for layer in template._flatten_layers(include_self=False, recursive=True)
            if counter_drawn(layer)
        ]
        self._random_states = {
            id(generator): values[id(generator.state)] for generator in generators if generator is not None
        }

    def __call__(self, x: Any, sample_weights: Any) -> tuple[Any, Any]:
        """(outputs, each fold's loss terms [k], or None when the model adds none) for the merged
        batch ``x``; ``sample_weights`` [k, b] are 0 where a fold's batch is padded."""
        import tensorflow as tf

        penalties: list[Any] = []

        def fold_weights(variable):
            return self._values[id(variable)]

        def stacked_form(layer):
            n_folds = self._n_folds
            if isinstance(layer, keras.layers.Dense):
                call = lambda inputs, **_: _dense(layer, fold_weights, inputs, n_folds)  # noqa: E731
            elif isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D)):
                call = lambda inputs, **_: self._convolution(layer, fold_weights, inputs, n_folds)  # noqa: E731
            elif isinstance(layer, keras.layers.BatchNormalization):
                call = lambda inputs, **_: _batch_normalization(  # noqa: E731
                    layer, fold_weights, inputs, sample_weights, n_folds
                )
            elif isinstance(layer, keras.layers.LayerNormalization):
                call = lambda inputs, **_: _layer_normalization(layer, fold_weights, inputs, n_folds)  # noqa: E731
            elif isinstance(layer, keras.layers.Embedding):
                call = lambda inputs, **_: _embedding(layer, fold_weights, inputs, n_folds)  # noqa: E731
            elif isinstance(layer, keras.layers.Layer):  # as Functional.call(training=True) calls it
                call = lambda *args, **kwargs: layer(*args, **{**kwargs, "training": True})  # noqa: E731
            else:  # an operation of the graph (keras.ops on symbolic tensors)
                return layer
            if layer.activity_regularizer is None:
                return call

            def regularized(*args, **kwargs):
                outputs = call(*args, **kwargs)
                penalties.append(_activity_penalty(layer.activity_regularizer, outputs, sample_weights, n_folds))
                return outputs

            return regularized

        random_numbers = draws.counter_draws(self._random_states) if self._random_states else contextlib.nullcontext()
        with random_numbers:
            outputs = _graph(self._template)._run_through_graph(x, operation_fn=stacked_form)
        for variable in self._template.trainable_variables:
            if variable.regularizer is not None:
                stacked = fold_weights(variable)
                penalties.append(tf.stack([variable.regularizer(stacked[k]) for k in range(self._n_folds)]))
        return outputs, (tf.add_n(penalties) if penalties else None)


def _per_fold(inputs, n_folds):
    import tensorflow as tf

    return tf.reshape(inputs, [n_folds, -1, *inputs.shape[1:]])


def _merged(outputs):
    import tensorflow as tf

    return tf.reshape(outputs, [-1, *outputs.shape[2:]])


def _per_fold_weights(sample_weights, rank):
    """[k, b] sample weights shaped to broadcast against [k, b, ...] values of ``rank``."""
    import tensorflow as tf

    return tf.reshape(sample_weights, [*sample_weights.shape, *[1] * (rank - 2)])


def _dense(layer, fold_weights, inputs, n_folds):
    import tensorflow as tf

    x = _per_fold(inputs, n_folds)
    outputs = tf.einsum("kb...i,kio->kb...o", x, fold_weights(layer.kernel))
    return _bias_and_activation(layer, fold_weights, outputs)


def _convolution(layer, fold_weights, inputs, n_folds):
    """A stride/dilation convolution as one product of patches with each fold's kernel."""
    import tensorflow as tf

    spatial = inputs.shape[1:-1]
    sizes, strides, dilations = layer.kernel_size, layer.strides, layer.dilation_rate
    padding = []
    out_sizes = []
    for size, kernel, stride, dilation in zip(spatial, sizes, strides, dilations):
        reach = (kernel - 1) * dilation + 1
        if layer.padding == "same":
            out = -(-size // stride)
            total = max((out - 1) * stride + reach - size, 0)
            padding.append((total // 2, total - total // 2))  # TensorFlow's SAME: the extra at the end
        else:
            out = (size - reach) // stride + 1
            padding.append((0, 0))
        out_sizes.append(out)
    x = tf.pad(inputs, [[0, 0], *padding, [0, 0]])
    patches = []
    for offsets in np.ndindex(*sizes):  # kernel taps in the kernel's own (row-major) order
        begin = [0] + [o * d for o, d in zip(offsets, dilations)] + [0]
        end = [0] + [b + (n - 1) * s + 1 for b, n, s in zip(begin[1:], out_sizes, strides)] + [0]
        patches.append(
            tf.strided_slice(
                x,
                begin,
                end,
                [1, *strides, 1],
                begin_mask=1 | (1 << (len(begin) - 1)),
                end_mask=1 | (1 << (len(begin) - 1)),
            )
        )
    patches = _per_fold(tf.concat(patches, axis=-1), n_folds)  # [k, b, *out, taps * channels]
    kernel = fold_weights(layer.kernel)
    kernel = tf.reshape(kernel, [n_folds, -1, kernel.shape[-1]])  # [k, taps * channels, filters]
    outputs = tf.einsum("kb...c,kcf->kb...f", patches, kernel)
    return _bias_and_activation(layer, fold_weights, outputs)


def _grouped_convolution(layer, fold_weights, inputs, n_folds):
    """The same convolution as one grouped convolution (``feature_group_count`` k, the GPU's
    form: one cuDNN kernel for every fold): the folds' samples side by side in the channels
    ([b, ..., k * channels]) and their kernels side by side in the filters, fold g's channels
    meeting fold g's kernel only."""
    import tensorflow as tf

    rank = len(layer.kernel_size)
    x = _per_fold(inputs, n_folds)  # [k, b, *spatial, c]
    channels = x.shape[-1]
    x = tf.transpose(x, [1, *range(2, rank + 2), 0, rank + 2])  # [b, *spatial, k, c]
    x = tf.reshape(x, [-1, *x.shape[1 : rank + 1], n_folds * channels])
    kernel = fold_weights(layer.kernel)  # [k, *taps, c, f]
    filters = kernel.shape[-1]
    kernel = tf.transpose(kernel, [*range(1, rank + 2), 0, rank + 2])  # [*taps, c, k, f]
    kernel = tf.reshape(kernel, [*layer.kernel_size, channels, n_folds * filters])
    outputs = tf.nn.convolution(
        x, kernel, strides=layer.strides, padding=layer.padding.upper(), dilations=layer.dilation_rate
    )  # [b, *out, k * f]
    outputs = tf.reshape(outputs, [-1, *outputs.shape[1 : rank + 1], n_folds, filters])
    outputs = tf.transpose(outputs, [rank + 1, 0, *range(1, rank + 1), rank + 2])  # [k, b, *out, f]
    return _bias_and_activation(layer, fold_weights, outputs)


def _bias_and_activation(layer, fold_weights, outputs):
    """The layer's bias (each fold's own) and activation on [k, b, ..., units] outputs."""
    if layer.use_bias:
        outputs += _over_folds(fold_weights(layer.bias), outputs.shape.rank)
    return layer.activation(_merged(outputs))


def _over_folds(values, rank):
    """[k, *trailing] per-fold values (a mask, a scale, a bias) shaped to broadcast against a
    rank-``rank`` tensor whose first axis is the fold axis and whose last axes are ``trailing``."""
    import tensorflow as tf

    return tf.reshape(values, [values.shape[0]] + [1] * (rank - values.shape.rank) + list(values.shape[1:]))


def _batch_normalization(layer, fold_weights, inputs, sample_weights, n_folds):
    """keras.layers.BatchNormalization in training, per fold: each fold's moments over its own
    samples (weight 1; padding has 0), its moving averages updated with the layer's momentum."""
    import tensorflow as tf

    x = _per_fold(inputs, n_folds)  # [k, b, ...]
    rank = x.shape.rank
    axis = _sample_axes(layer.axis, rank - 1)[0] + 1
    reduced = [a for a in range(1, rank) if a != axis]
    weights = tf.ones([n_folds, x.shape[1]]) if sample_weights is None else sample_weights
    weights = _per_fold_weights(weights, rank)
    # tf.nn.moments, as Keras computes them, with each sample weighted: padding counts for nothing.
    count = tf.reduce_sum(weights, axis=reduced, keepdims=True) * math.prod(x.shape[a] for a in reduced[1:])
    count = tf.maximum(count, 1.0)  # a fold with no sample (not training) stays finite
    mean = tf.reduce_sum(x * weights, axis=reduced, keepdims=True) / count
    variance = (
        tf.reduce_sum(tf.math.squared_difference(x, tf.stop_gradient(mean)) * weights, axis=reduced, keepdims=True)
        / count
    )
    shape = [n_folds] + [x.shape[a] if a == axis else 1 for a in range(1, rank)]

    def per_fold(variable):
        return tf.reshape(fold_weights(variable), shape)

    for moving, batch in ((layer.moving_mean, mean), (layer.moving_variance, variance)):
        stacked = fold_weights(moving)
        stacked.assign(stacked * layer.momentum + tf.reshape(batch, stacked.shape) * (1.0 - layer.momentum))
    outputs = tf.nn.batch_normalization(
        x,
        mean,
        variance,
        offset=per_fold(layer.beta) if layer.center else None,
        scale=per_fold(layer.gamma) if layer.scale else None,
        variance_epsilon=layer.epsilon,
    )
    return _merged(outputs)


def _layer_normalization(layer, fold_weights, inputs, n_folds):
    """keras.layers.LayerNormalization (per sample) with each fold's scale and offset."""
    x = _per_fold(inputs, n_folds)
    rank = x.shape.rank
    axes = [a + 1 for a in _sample_axes(layer.axis, rank - 1)]
    shape = [n_folds] + [x.shape[a] if a in axes else 1 for a in range(1, rank)]

    def per_fold(variable):
        return keras.ops.reshape(fold_weights(variable), shape)

    outputs = keras.ops.layer_normalization(
        x,
        per_fold(layer.gamma) if layer.scale else None,
        per_fold(layer.beta) if layer.center else None,
        axis=axes,
        epsilon=layer.epsilon,
        rms_scaling=layer.rms_scaling,
    )
    return _merged(outputs)


def _embedding(layer, fold_weights, inputs, n_folds):
    """keras.layers.Embedding with each fold's table (``ops.take``: negative indices from the end)."""
    import tensorflow as tf

    ids = inputs if inputs.dtype in (tf.int32, tf.int64) else tf.cast(inputs, tf.int32)
    table = fold_weights(layer.embeddings)
    ids = _per_fold(tf.where(ids < 0, ids + tf.cast(table.shape[1], ids.dtype), ids), n_folds)
    return _merged(tf.gather(table, ids, batch_dims=1))


def _activity_penalty(regularizer, outputs, sample_weights, n_folds):
    """[k]: each fold's activity regularization of a layer's ``outputs``, over its own samples
    and divided by their number, as Keras' Layer.__call__ adds it."""
    import tensorflow as tf

    x = _per_fold(outputs, n_folds)
    if sample_weights is None:
        return tf.stack([regularizer(x[k]) / x.shape[1] for k in range(n_folds)])
    kept = x * _per_fold_weights(sample_weights, x.shape.rank)
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
    batches merged fold-major, different per fold so that mixing across folds shows. The fold
    models' state is as it was afterwards."""
    import tensorflow as tf

    template, n_folds = models[0], len(models)
    states = [stacked_state_variables(model) or [] for model in models]
    before = [[np.asarray(variable) for variable in fold] for fold in states]
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
    drawn = any(counter_drawn(layer) for layer in template._flatten_layers())
    random_numbers = draws.counter_draws if drawn else contextlib.nullcontext
    own, own_penalties = [], []
    try:
        for model, batch in zip(models, batches):
            with random_numbers():
                own.append(np.asarray(model(batch, training=True)))
            own_penalties.append(float(sum(np.asarray(loss) for loss in model.losses)))
        after = [[np.asarray(variable) for variable in fold] for fold in states]
    finally:
        for fold, values_before in zip(states, before):
            for variable, value in zip(fold, values_before):
                variable.assign(value)

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

    def by_norm(gradients, _):  # keras BaseOptimizer._clip_by_norm, per fold
        clipped = []
        for gradient in gradients:
            l2sum = _over_folds(fold_square_sums(gradient), gradient.shape.rank)
            positive = l2sum > 0
            l2norm = tf.where(positive, tf.sqrt(tf.where(positive, l2sum, tf.ones_like(l2sum))), l2sum)
            clipped.append(gradient * threshold / tf.maximum(l2norm, threshold))
        return clipped

    def by_global_norm(gradients, norm):  # keras clip_by_global_norm, per fold
        scale = threshold * tf.minimum(1.0 / norm, 1.0 / threshold) + (norm - norm)
        return [g * _over_folds(scale, g.shape.rank) for g in gradients]

    def by_value(gradients, _):
        return [tf.clip_by_value(g, -threshold, threshold) for g in gradients]

    if kind == NO_CLIPPING:
        return lambda gradients, _: gradients
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
        per_fold = {}
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

        self._load(live)
        indices, weights = self.epoch_batches(epoch, live)
        mask = np.isin(np.arange(len(self._engines)), live)
        with tf.device(self._engines[0].device):
            arguments = tf.constant(indices), tf.constant(weights), tf.constant(mask)
        started = time.perf_counter()
        tally = EpochTally(*(np.asarray(value) for value in self._train_epoch(*arguments)))
        seconds = time.perf_counter() - started
        self._store(live)
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
                    for i in live:
                        per_fold[i].assign(stacked.value[i] if stacked.shape.rank else stacked.value)

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
        own = [*template.trainable_variables, *(stacked_state_variables(template) or [])]
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
    per_fold_states = list(zip(*(stacked_state_variables(model) or [] for model in models)))
    states = [
        keras.Variable(over_folds(per_fold), dtype=per_fold[0].dtype, trainable=False, name=per_fold[0].name)
        for per_fold in per_fold_states
    ]
    # Clipping is done per fold before the optimizer sees the gradients; everything the
    # optimizers below do is elementwise, so each fold's slice is updated on its own.
    optimizer = recipe.make(clipping=False)
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
            variable.assign(tf.where(_over_folds(applied, variable.shape.rank), variable.value, before))
        for state, before in zip(stacked.states, states_before):
            state.assign(tf.where(_over_folds(active, state.shape.rank), state.value, before))
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
