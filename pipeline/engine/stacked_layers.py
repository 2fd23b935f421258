"""The registry of stacked forms: for each Keras layer class with trainable weights that stacked
folds can train, its forward pass for k folds at once, what of a layer's configuration that form
does not cover, and which of its non-trainable variables are per-fold state it updates.

A form takes the folds' inputs merged fold-major ([k * b, ...]) and a ``Folds`` (each template
variable's stacked value with a leading fold axis, the folds' sample weights, the convolution
form the plan chose) and returns the merged outputs. It computes what each fold's own layer
computes in training, up to float rounding; ``pipeline.engine.stacked`` checks that on the
trial's own models before it trains them stacked. Adding a layer: one ``@stacked_form(...)``
function here and one row of ``tests/test_stacked.py``'s parametrised forward check.

Layers with no trainable weights are not here: a weightless layer (pooling, activation, a random
layer drawing per fold) and a frozen one (``trainable = False``, its weights the same in every
fold: a backbone loaded from a file) are called as they are, on the merged batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import numpy as np

from pipeline.contract.plan import StackedConvolutions


class Folds(NamedTuple):
    """What a stacked form needs besides the layer and its inputs: the number of folds, each
    template variable's stacked value (``weights(variable)``: [k, ...]), the folds' sample
    weights ([k, b], 0 where a fold's batch is padded) and how convolutions are stacked."""

    n: int
    weights: Callable[[Any], Any]
    sample_weights: Any
    convolutions: StackedConvolutions


class StackedLayer(NamedTuple):
    """One layer class's entry: its ``form``, its ``blocker`` (why a layer of the class, as
    configured, has no stacked form, or None) and its ``state`` (the layer's variables the form
    updates per fold, as the fold's own layer does in training)."""

    form: Callable[[Any, Folds, Any], Any]
    blocker: Callable[[Any], str | None]
    state: Callable[[Any], list[Any]]


STACKED_FORMS: dict[type, StackedLayer] = {}


def _no_blocker(layer: Any) -> str | None:
    return None


def _no_state(layer: Any) -> list[Any]:
    return []


def stacked_form(
    *classes: type,
    blocker: Callable[[Any], str | None] = _no_blocker,
    state: Callable[[Any], list[Any]] = _no_state,
) -> Callable[[Callable[[Any, Folds, Any], Any]], Callable[[Any, Folds, Any], Any]]:
    """Register the decorated function as the stacked form of ``classes`` (and their subclasses)."""

    def register(form: Callable[[Any, Folds, Any], Any]) -> Callable[[Any, Folds, Any], Any]:
        for cls in classes:
            STACKED_FORMS[cls] = StackedLayer(form, blocker, state)
        return form

    return register


def stacked_entry(layer: Any) -> StackedLayer | None:
    """The registry entry of a layer's class or of its nearest registered base class."""
    return next((STACKED_FORMS[cls] for cls in type(layer).__mro__ if cls in STACKED_FORMS), None)


def layer_blocker(layer: Any) -> str | None:
    """Why a layer with trainable weights has no stacked form, or None."""
    entry = stacked_entry(layer)
    if entry is None:
        return f"{type(layer).__name__} layers have no stacked form"
    return entry.blocker(layer)


def state_variables(layer: Any) -> list[Any]:
    """A layer's variables its stacked form updates per fold (none for an unregistered layer)."""
    entry = stacked_entry(layer)
    return entry.state(layer) if entry is not None else []


def sample_axes(axis: Any, rank: int) -> list[int]:
    """A layer's axis argument as axes of its [batch, ...] input of ``rank``, non-negative."""
    return sorted(a % rank for a in (axis if isinstance(axis, (list, tuple)) else [axis]))


def broadcast_over_folds(values: Any, rank: int) -> Any:
    """[k, *trailing] per-fold values (a mask, a scale, a bias) shaped to broadcast against a
    rank-``rank`` tensor whose first axis is the fold axis and whose last axes are ``trailing``."""
    import tensorflow as tf

    return tf.reshape(values, [values.shape[0]] + [1] * (rank - values.shape.rank) + list(values.shape[1:]))


def split_folds(inputs: Any, n_folds: int) -> Any:
    """[k * b, ...] merged values as [k, b, ...]."""
    import tensorflow as tf

    return tf.reshape(inputs, [n_folds, -1, *inputs.shape[1:]])


def merge_folds(outputs: Any) -> Any:
    """[k, b, ...] per-fold values merged fold-major as [k * b, ...]."""
    import tensorflow as tf

    return tf.reshape(outputs, [-1, *outputs.shape[2:]])


def per_fold_sample_weights(sample_weights: Any, rank: int) -> Any:
    """[k, b] sample weights shaped to broadcast against [k, b, ...] values of ``rank``."""
    import tensorflow as tf

    return tf.reshape(sample_weights, [*sample_weights.shape, *[1] * (rank - 2)])


def _folds_in_channels(inputs: Any, n_folds: int) -> Any:
    """[k * b, *spatial, c] merged inputs as [b, *spatial, k * c]: the folds side by side in the
    channels, fold g's channels at g * c."""
    import tensorflow as tf

    x = split_folds(inputs, n_folds)
    rank = x.shape.rank - 3
    x = tf.transpose(x, [1, *range(2, rank + 2), 0, rank + 2])  # [b, *spatial, k, c]
    return tf.reshape(x, [-1, *x.shape[1 : rank + 1], n_folds * x.shape[-1]])


def _folds_from_channels(outputs: Any, n_folds: int) -> Any:
    """[b, *spatial, k * f] outputs with the folds side by side in the channels, as [k, b, *spatial, f]."""
    import tensorflow as tf

    rank = outputs.shape.rank - 2
    outputs = tf.reshape(outputs, [-1, *outputs.shape[1 : rank + 1], n_folds, outputs.shape[-1] // n_folds])
    return tf.transpose(outputs, [rank + 1, 0, *range(1, rank + 1), rank + 2])


def _bias_and_activation(layer: Any, folds: Folds, outputs: Any) -> Any:
    """The layer's bias (each fold's own) and activation on [k, b, ..., units] outputs, merged."""
    if layer.use_bias:
        outputs += broadcast_over_folds(folds.weights(layer.bias), outputs.shape.rank)
    return layer.activation(merge_folds(outputs))


def _channels_last_blocker(layer: Any) -> str | None:
    if layer.data_format != "channels_last" or layer.padding not in ("same", "valid"):
        return f"convolution {layer.name!r} ({layer.data_format}, padding {layer.padding!r}) has no stacked form"
    return None


@stacked_form(keras.layers.Dense)
def _dense(layer: Any, folds: Folds, inputs: Any) -> Any:
    import tensorflow as tf

    x = split_folds(inputs, folds.n)
    outputs = tf.einsum("kb...i,kio->kb...o", x, folds.weights(layer.kernel))
    return _bias_and_activation(layer, folds, outputs)


def _convolution_blocker(layer: Any) -> str | None:
    if layer.groups != 1 or layer.data_format != "channels_last" or layer.padding not in ("same", "valid"):
        return (
            f"convolution {layer.name!r} (groups {layer.groups}, {layer.data_format}, padding "
            f"{layer.padding!r}) has no stacked form"
        )
    return None


@stacked_form(keras.layers.Conv1D, keras.layers.Conv2D, blocker=_convolution_blocker)
def _convolution(layer: Any, folds: Folds, inputs: Any) -> Any:
    """Patches (``StackedConvolutions``): a stride/dilation convolution as one product of patches
    with each fold's kernel. Grouped: one grouped convolution (``feature_group_count`` k, the
    GPU's form: one cuDNN kernel for every fold), fold g's channels meeting fold g's kernel only."""
    import tensorflow as tf

    n_folds = folds.n
    kernel = folds.weights(layer.kernel)  # [k, *taps, c, f]
    if folds.convolutions == "grouped":
        rank = len(layer.kernel_size)
        channels, filters = kernel.shape[-2], kernel.shape[-1]
        kernel = tf.transpose(kernel, [*range(1, rank + 2), 0, rank + 2])  # [*taps, c, k, f]
        kernel = tf.reshape(kernel, [*layer.kernel_size, channels, n_folds * filters])
        outputs = tf.nn.convolution(
            _folds_in_channels(inputs, n_folds),
            kernel,
            strides=layer.strides,
            padding=layer.padding.upper(),
            dilations=layer.dilation_rate,
        )  # [b, *out, k * f]
        return _bias_and_activation(layer, folds, _folds_from_channels(outputs, n_folds))
    patches = split_folds(_patches(layer, inputs), n_folds)  # [k, b, *out, taps * channels]
    kernel = tf.reshape(kernel, [n_folds, -1, kernel.shape[-1]])  # [k, taps * channels, filters]
    outputs = tf.einsum("kb...c,kcf->kb...f", patches, kernel)
    return _bias_and_activation(layer, folds, outputs)


def _patches(layer: Any, inputs: Any) -> Any:
    """[n, *out, taps * channels]: each output position's input patch under the layer's kernel
    size, strides, dilation and padding, the taps in the kernel's own (row-major) order."""
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
    for offsets in np.ndindex(*sizes):
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
    return tf.concat(patches, axis=-1)


def _depthwise_per_fold(layer: Any, folds: Folds, inputs: Any, kernel: Any) -> Any:
    """[k, b, *out, c * m]: each fold's depthwise convolution with its own ``kernel`` ([k, *taps,
    c, m]), as one depthwise convolution of the folds side by side in the channels (a depthwise
    convolution never mixes channels, so never folds)."""
    import tensorflow as tf

    rank = len(layer.kernel_size)
    channels, multiplier = kernel.shape[-2], kernel.shape[-1]
    kernel = tf.transpose(kernel, [*range(1, rank + 1), 0, rank + 1, rank + 2])  # [*taps, k, c, m]
    kernel = tf.reshape(kernel, [*layer.kernel_size, folds.n * channels, multiplier])
    outputs = keras.ops.depthwise_conv(
        _folds_in_channels(inputs, folds.n),
        kernel,
        strides=layer.strides,
        padding=layer.padding,
        dilation_rate=layer.dilation_rate,
    )  # [b, *out, k * c * m]: fold g's outputs at g * c * m, channel-major as Keras orders them
    return _folds_from_channels(outputs, folds.n)


@stacked_form(keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D, blocker=_channels_last_blocker)
def _depthwise_convolution(layer: Any, folds: Folds, inputs: Any) -> Any:
    return _bias_and_activation(layer, folds, _depthwise_per_fold(layer, folds, inputs, folds.weights(layer.kernel)))


@stacked_form(keras.layers.SeparableConv1D, keras.layers.SeparableConv2D, blocker=_channels_last_blocker)
def _separable_convolution(layer: Any, folds: Folds, inputs: Any) -> Any:
    """Each fold's depthwise convolution, then its pointwise kernel as a product over channels."""
    import tensorflow as tf

    depthwise = _depthwise_per_fold(layer, folds, inputs, folds.weights(layer.depthwise_kernel))
    pointwise = folds.weights(layer.pointwise_kernel)  # [k, 1..., c * m, f]
    pointwise = tf.reshape(pointwise, [folds.n, pointwise.shape[-2], pointwise.shape[-1]])
    outputs = tf.einsum("kb...c,kcf->kb...f", depthwise, pointwise)
    return _bias_and_activation(layer, folds, outputs)


@stacked_form(keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, blocker=_channels_last_blocker)
def _transposed_convolution(layer: Any, folds: Folds, inputs: Any) -> Any:
    """One transposed convolution of the folds side by side in the channels with a block-diagonal
    kernel: fold g's channels meet fold g's kernel only (the other blocks are zeros, which add
    nothing); k times a fold's arithmetic, the same operation Keras calls."""
    import tensorflow as tf

    kernel = folds.weights(layer.kernel)  # [k, *taps, f, c]
    filters, channels = kernel.shape[-2], kernel.shape[-1]
    blocks = tf.einsum("g...fc,gh->...gfhc", kernel, tf.eye(folds.n, dtype=kernel.dtype))
    blocks = tf.reshape(blocks, [*layer.kernel_size, folds.n * filters, folds.n * channels])
    outputs = keras.ops.conv_transpose(
        _folds_in_channels(inputs, folds.n),
        blocks,
        strides=list(layer.strides),
        padding=layer.padding,
        output_padding=layer.output_padding,
        dilation_rate=layer.dilation_rate,
    )  # [b, *out, k * f]
    return _bias_and_activation(layer, folds, _folds_from_channels(outputs, folds.n))


def _batch_normalization_blocker(layer: Any) -> str | None:
    if layer.renorm or layer.synchronized:
        return f"batch normalization {layer.name!r} with {'renorm' if layer.renorm else 'synchronized'}=True"
    return None


def _moving_statistics(layer: Any) -> list[Any]:
    """A trainable BatchNormalization's moving mean and variance (a frozen one's are constants)."""
    return [layer.moving_mean, layer.moving_variance] if layer.trainable else []


@stacked_form(keras.layers.BatchNormalization, blocker=_batch_normalization_blocker, state=_moving_statistics)
def _batch_normalization(layer: Any, folds: Folds, inputs: Any) -> Any:
    """keras.layers.BatchNormalization in training, per fold: each fold's moments over its own
    samples (weight 1; padding has 0), its moving averages updated with the layer's momentum."""
    import tensorflow as tf

    n_folds = folds.n
    x = split_folds(inputs, n_folds)  # [k, b, ...]
    rank = x.shape.rank
    axis = sample_axes(layer.axis, rank - 1)[0] + 1
    reduced = [a for a in range(1, rank) if a != axis]
    weights = tf.ones([n_folds, x.shape[1]]) if folds.sample_weights is None else folds.sample_weights
    weights = per_fold_sample_weights(weights, rank)
    # tf.nn.moments, as Keras computes them, with each sample weighted: padding counts for nothing.
    count = tf.reduce_sum(weights, axis=reduced, keepdims=True) * math.prod(x.shape[a] for a in reduced[1:])
    count = tf.maximum(count, 1.0)  # a fold with no sample (not training) stays finite
    mean = tf.reduce_sum(x * weights, axis=reduced, keepdims=True) / count
    variance = (
        tf.reduce_sum(tf.math.squared_difference(x, tf.stop_gradient(mean)) * weights, axis=reduced, keepdims=True)
        / count
    )
    shape = [n_folds] + [x.shape[a] if a == axis else 1 for a in range(1, rank)]

    def fold_values(variable):
        return tf.reshape(folds.weights(variable), shape)

    for moving, batch in ((layer.moving_mean, mean), (layer.moving_variance, variance)):
        stacked = folds.weights(moving)
        stacked.assign(stacked * layer.momentum + tf.reshape(batch, stacked.shape) * (1.0 - layer.momentum))
    outputs = tf.nn.batch_normalization(
        x,
        mean,
        variance,
        offset=fold_values(layer.beta) if layer.center else None,
        scale=fold_values(layer.gamma) if layer.scale else None,
        variance_epsilon=layer.epsilon,
    )
    return merge_folds(outputs)


def _layer_normalization_blocker(layer: Any) -> str | None:
    if 0 in sample_axes(layer.axis, len(layer.input.shape)):
        return f"layer normalization {layer.name!r} over the batch axis"
    return None


@stacked_form(keras.layers.LayerNormalization, blocker=_layer_normalization_blocker)
def _layer_normalization(layer: Any, folds: Folds, inputs: Any) -> Any:
    """keras.layers.LayerNormalization (per sample) with each fold's scale and offset."""
    x = split_folds(inputs, folds.n)
    rank = x.shape.rank
    axes = [a + 1 for a in sample_axes(layer.axis, rank - 1)]
    shape = [folds.n] + [x.shape[a] if a in axes else 1 for a in range(1, rank)]

    def fold_values(variable):
        return keras.ops.reshape(folds.weights(variable), shape)

    outputs = keras.ops.layer_normalization(
        x,
        fold_values(layer.gamma) if layer.scale else None,
        fold_values(layer.beta) if layer.center else None,
        axis=axes,
        epsilon=layer.epsilon,
        rms_scaling=layer.rms_scaling,
    )
    return merge_folds(outputs)


def _embedding_blocker(layer: Any) -> str | None:
    if layer.mask_zero:
        return f"embedding {layer.name!r} with mask_zero=True: masks are not carried through the stacked layers"
    return None


@stacked_form(keras.layers.Embedding, blocker=_embedding_blocker)
def _embedding(layer: Any, folds: Folds, inputs: Any) -> Any:
    """keras.layers.Embedding with each fold's table (``ops.take``: negative indices from the end)."""
    import tensorflow as tf

    ids = inputs if inputs.dtype in (tf.int32, tf.int64) else tf.cast(inputs, tf.int32)
    table = folds.weights(layer.embeddings)
    ids = split_folds(tf.where(ids < 0, ids + tf.cast(table.shape[1], ids.dtype), ids), folds.n)
    return merge_folds(tf.gather(table, ids, batch_dims=1))
