"""Keras' affine image transform in ops XLA compiles, with TensorFlow's kernel's numbers.

RandomRotation, RandomTranslation and RandomZoom move each image by an affine transform, which
Keras' TensorFlow backend applies with ``ImageProjectiveTransformV3``: an op XLA has no kernel for,
so a model with one of them trained without XLA, and not stacked. ``projective_transform`` computes
what that op computes, pixel for pixel as its CPU and GPU kernel does (``image_ops.h``: each output
pixel's input coordinates, mapped inside the image by the fill mode, then read nearest or bilinear,
outside the image the fill value), from gathers and elementwise ops that XLA fuses. While foldsweep
draws a model's random numbers in a step XLA compiles (``pipeline.engine.draws.counter_draws``),
Keras' ``affine_transform`` runs this instead: the layer's own ``call`` still decides everything
else. Without XLA, TensorFlow's op stays: its one kernel is faster than these ops run one by one.
"""

from __future__ import annotations

from typing import Any

FILL_MODES = ("reflect", "wrap", "constant", "nearest")
INTERPOLATIONS = ("nearest", "bilinear")


def affine_transform(
    images: Any,
    transform: Any,
    interpolation: str = "bilinear",
    fill_mode: str = "constant",
    fill_value: Any = 0,
    data_format: str | None = None,
) -> Any:
    """``keras.src.backend.tensorflow.image.affine_transform``, its parameters and checks, computed
    by ``projective_transform``."""
    import keras
    import tensorflow as tf

    data_format = data_format or keras.config.image_data_format()
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"Invalid value for argument `interpolation`: {interpolation}")
    if fill_mode not in FILL_MODES:
        raise ValueError(f"Invalid value for argument `fill_mode`: {fill_mode}")
    if len(images.shape) not in (3, 4) or len(transform.shape) not in (1, 2):
        raise ValueError(f"affine_transform of images {images.shape} by transforms {transform.shape}")
    single = len(images.shape) == 3
    if single:
        images = tf.expand_dims(images, axis=0)
    if len(transform.shape) == 1:
        transform = tf.expand_dims(transform, axis=0)
    if data_format == "channels_first":
        images = tf.transpose(images, (0, 2, 3, 1))
    moved = projective_transform(
        images,
        tf.cast(transform, tf.float32),
        interpolation=interpolation,
        fill_mode=fill_mode,
        fill_value=fill_value,
    )
    moved = tf.ensure_shape(moved, images.shape)
    if data_format == "channels_first":
        moved = tf.transpose(moved, (0, 3, 1, 2))
    return tf.squeeze(moved, axis=0) if single else moved


def projective_transform(images: Any, transforms: Any, *, interpolation: str, fill_mode: str, fill_value: Any) -> Any:
    """``ImageProjectiveTransformV3(images, transforms, output_shape=images' [H, W])``: images
    [n, h, w, c], transforms [n or 1, 8] float32 mapping each output pixel (x, y) to the input point
    ((a0 x + a1 y + a2) / p, (b0 x + b1 y + b2) / p), p = c0 x + c1 y + 1, in float32 as the
    kernel computes it."""
    import tensorflow as tf

    shape = tf.shape(images)
    n, channels = shape[0], _static_or(images.shape[3], shape[3])
    height, width = _static_or(images.shape[1], shape[1]), _static_or(images.shape[2], shape[2])
    xs = tf.cast(tf.range(width), tf.float32)[tf.newaxis, tf.newaxis, :]
    ys = tf.cast(tf.range(height), tf.float32)[tf.newaxis, :, tf.newaxis]
    t = [transforms[:, i, tf.newaxis, tf.newaxis] for i in range(8)]
    projection = t[6] * xs + t[7] * ys + 1.0
    input_x = (t[0] * xs + t[1] * ys + t[2]) / projection
    input_y = (t[3] * xs + t[4] * ys + t[5]) / projection
    x = _map_coordinate(input_x, width, fill_mode)
    y = _map_coordinate(input_y, height, fill_mode)
    flat = tf.reshape(images, [-1, channels])
    fill = tf.cast(fill_value, images.dtype)
    first = tf.range(n)[:, tf.newaxis, tf.newaxis] * (height * width)

    def read(row: Any, column: Any) -> Any:
        # The pixel at integral (row, column), or the fill value outside the image.
        inside = (row >= 0.0) & (row < tf.cast(height, tf.float32)) & (column >= 0.0)
        inside &= column < tf.cast(width, tf.float32)
        row, column = (tf.cast(tf.where(inside, value, 0.0), tf.int32) for value in (row, column))
        values = tf.gather(flat, first + row * width + column)
        return tf.where(inside[..., tf.newaxis], values, fill)

    if interpolation == "nearest":
        moved = read(_round_half_away(y), _round_half_away(x))
    else:
        y_floor, x_floor = tf.floor(y), tf.floor(x)
        y_ceil, x_ceil = y_floor + 1.0, x_floor + 1.0
        weights = [w[..., tf.newaxis] for w in (x_ceil - x, x - x_floor, y_ceil - y, y - y_floor)]

        def values(row: Any, column: Any) -> Any:
            return tf.cast(read(row, column), tf.float32)

        at_floor = weights[0] * values(y_floor, x_floor) + weights[1] * values(y_floor, x_ceil)
        at_ceil = weights[0] * values(y_ceil, x_floor) + weights[1] * values(y_ceil, x_ceil)
        moved = tf.cast(weights[2] * at_floor + weights[3] * at_ceil, images.dtype)
    # A point at infinity (p = 0) is outside the image.
    return tf.where((projection == 0.0)[..., tf.newaxis], fill, moved)


def _static_or(size: int | None, dynamic: Any) -> Any:
    return dynamic if size is None else size


def _map_coordinate(coordinate: Any, length: Any, fill_mode: str) -> Any:
    """An input coordinate mapped inside [0, length - 1] as the kernel's ``MapCoordinate`` maps it:
    reflected ([abcd] as [dcba|abcd|dcba]), wrapped, clamped (``nearest``), or left (``constant``,
    read as the fill value outside)."""
    import tensorflow as tf

    if fill_mode == "constant":
        return coordinate
    last = tf.cast(length - 1, tf.float32)
    if fill_mode == "nearest":
        return tf.clip_by_value(coordinate, 0.0, last)
    size = tf.cast(length, tf.float32)
    below, above = coordinate < 0.0, coordinate > last
    if fill_mode == "reflect":
        twice = 2.0 * size
        low = twice * tf.floor(-coordinate / twice) + coordinate
        low = tf.where(low < -size, low + twice, -low - 1.0)
        high = coordinate - twice * tf.floor(coordinate / twice)
        high = tf.where(high >= size, twice - high - 1.0, high)
    else:  # wrap
        low = coordinate + size * (tf.floor(-coordinate / last) + 1.0)
        high = coordinate - size * tf.floor(coordinate / last)
    mapped = tf.where(below, low, tf.where(above, high, coordinate))
    mapped = tf.where(size <= 1.0, tf.zeros_like(mapped), mapped)
    return tf.clip_by_value(mapped, 0.0, tf.maximum(last, 0.0))


def _round_half_away(value: Any) -> Any:
    """``std::round``: halves away from zero (``tf.round`` rounds them to even)."""
    import tensorflow as tf

    return tf.sign(value) * tf.floor(tf.abs(value) + 0.5)
