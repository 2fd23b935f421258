"""foldsweep's affine image transform computes what TensorFlow's ImageProjectiveTransformV3 does,
pixel for pixel, and compiles under XLA, which that op does not."""

import numpy as np
import pytest

from pipeline.engine.image_transforms import FILL_MODES, INTERPOLATIONS, projective_transform


def _transforms(n):
    """Rotations, shifts, zooms and shears about the centre, some projective, and a flip: [n, 8]."""
    rng = np.random.default_rng(3)
    transforms = []
    for i in range(n):
        angle, scale = rng.uniform(-np.pi, np.pi), rng.uniform(0.5, 2.0)
        cos, sin = np.cos(angle) / scale, np.sin(angle) / scale
        shift = rng.uniform(-12, 12, size=2)
        perspective = rng.uniform(-0.02, 0.02, size=2) if i % 3 == 2 else (0.0, 0.0)
        transforms.append([cos, -sin, shift[0], sin, cos, shift[1], *perspective])
    transforms[0] = [-1, 0, 8, 0, 1, 0, 0, 0]  # a flip: coordinates land on pixels, and half-way
    transforms[1] = [1, 0, -0.5, 0, 1, 2.5, 0, 0]
    return np.asarray(transforms, np.float32)


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
@pytest.mark.parametrize("fill_mode", FILL_MODES)
def test_the_transform_is_tensorflows_pixel_for_pixel(fill_mode, interpolation):
    import tensorflow as tf

    images = np.random.default_rng(0).normal(size=(12, 7, 9, 3)).astype(np.float32)
    transforms = _transforms(12)
    expected = tf.raw_ops.ImageProjectiveTransformV3(
        images=images,
        transforms=transforms,
        output_shape=[7, 9],
        fill_value=0.5,
        interpolation=interpolation.upper(),
        fill_mode=fill_mode.upper(),
    ).numpy()

    def transformed(images, transforms):
        return projective_transform(
            images, transforms, interpolation=interpolation, fill_mode=fill_mode, fill_value=0.5
        )

    np.testing.assert_array_equal(transformed(tf.constant(images), tf.constant(transforms)).numpy(), expected)
    compiled = tf.function(transformed, jit_compile=True)(tf.constant(images), tf.constant(transforms)).numpy()
    np.testing.assert_allclose(compiled, expected, rtol=1e-5, atol=1e-5)
