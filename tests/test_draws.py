"""foldsweep's own random numbers for Keras' random layers (pipeline.engine.draws): Keras'
semantics (rate, noise_shape, scaling, nothing at validation, the generator's advance), the
distributions Keras draws from (its stream differs), independent across folds and steps,
reproducible from the seeds, a stacked fold's numbers its own, and fused by XLA without a random
number generator op."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline.engine.draws import counter_draws, counter_normal, counter_uniform

pytestmark = pytest.mark.training  # runs layers and compiles small programs

ROWS = np.ones((256, 64), np.float32)


def drawn(layer, x=ROWS, *, training=True):
    with counter_draws():
        return np.asarray(layer(x, training=training))


def test_a_dropout_mask_keeps_keras_rate_and_scaling_and_nothing_at_validation():
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dropout(0.3)
    start = np.asarray(layer.seed_generator.state).copy()
    keep = np.stack([drawn(layer) for _ in range(50)])  # 50 steps of 256 x 64
    # Kept values are scaled by 1 / (1 - rate), as Keras' dropout scales them; dropped are 0.
    assert set(np.unique(keep)) == {0.0, np.float32(1 / 0.7)}
    rates = (keep > 0).mean(axis=(1, 2))
    # 16,384 draws per step: the keep rate's standard deviation is 0.0036; over 50 steps, 0.0005.
    assert abs(rates.mean() - 0.7) < 0.002 and rates.std() < 0.008
    assert np.asarray(layer.seed_generator.state).tolist() == [start[0], start[1] + 50]  # one draw per step
    assert np.array_equal(drawn(layer, training=False), ROWS)
    # Keras' own generator draws other numbers from the same distribution.
    keras_rate = (np.asarray(layer(ROWS, training=True)) > 0).mean()
    assert abs(keras_rate - 0.7) < 0.015 and not np.array_equal(drawn(layer), np.asarray(layer(ROWS, training=True)))


def test_masks_are_independent_across_folds_steps_and_elements():
    # Fold models are built under different seeds: their generators start at different seeds.
    keep = counter_uniform(tf.constant([[11, 5], [12, 5], [11, 6]], tf.int64), [3 * 4096]).numpy().reshape(3, -1) >= 0.5
    same_step_other_fold, same_fold_next_step = keep[0] == keep[1], keep[0] == keep[2]
    # Independent fair masks agree on half the elements (standard deviation 0.008 at 4,096).
    assert abs(same_step_other_fold.mean() - 0.5) < 0.03 and abs(same_fold_next_step.mean() - 0.5) < 0.03
    assert abs((keep[0, 1:] == keep[0, :-1]).mean() - 0.5) < 0.03  # neighbouring elements
    uniforms = counter_uniform(tf.constant([[7, 0]], tf.int64), [1 << 16]).numpy()
    assert 0 <= uniforms.min() and uniforms.max() < 1 and abs(uniforms.mean() - 0.5) < 0.005
    assert abs(uniforms.var() - 1 / 12) < 0.002
    assert np.histogram(uniforms, bins=16, range=(0, 1))[0].min() > (1 << 16) / 16 * 0.95


def test_normals_and_the_noise_layers_have_keras_moments():
    normals = counter_normal(tf.constant([[3, 9]], tf.int64), [1 << 16]).numpy()
    assert abs(normals.mean()) < 0.02 and abs(normals.std() - 1) < 0.02
    assert abs((np.abs(normals) < 1).mean() - 0.6827) < 0.01  # a normal's mass within one sigma
    keras.utils.set_random_seed(1)
    noise = drawn(keras.layers.GaussianNoise(0.5)) - ROWS
    assert abs(noise.mean()) < 0.01 and abs(noise.std() - 0.5) < 0.01
    scaled = drawn(keras.layers.GaussianDropout(0.2))  # multiplied by a normal of mean 1, sd sqrt(0.2 / 0.8)
    assert abs(scaled.mean() - 1) < 0.01 and abs(scaled.std() - 0.5) < 0.01
    # Zeros in: a kept element comes out as the layer's offset b, a dropped one as a * alpha_p + b < b.
    alpha = drawn(keras.layers.AlphaDropout(0.2), np.zeros_like(ROWS))
    assert len(np.unique(alpha.round(5))) == 2 and abs((alpha == alpha.max()).mean() - 0.8) < 0.01


def test_noise_shape_shares_one_draw_where_keras_does():
    keras.utils.set_random_seed(2)
    x = np.ones((8, 10, 6), np.float32)
    channels = drawn(keras.layers.SpatialDropout1D(0.5), x)
    assert (channels == channels[:, :1, :]).all()  # a whole channel of a sample kept or dropped
    assert 0 < (channels == 0).mean() < 1
    steps = drawn(keras.layers.Dropout(0.5, noise_shape=(None, 1, 6)), x)
    assert (steps == steps[:, :1, :]).all() and not (steps == steps[:1]).all()


def test_the_same_seeds_draw_the_same_numbers_and_a_stacked_folds_share_is_its_own():
    seeds = tf.constant([[101, 4], [202, 4], [303, 4]], tf.int64)
    stacked = counter_uniform(seeds, [3 * 5, 7]).numpy()
    stacked_normals = counter_normal(seeds, [3 * 5, 7]).numpy()
    for k in range(3):
        alone = counter_uniform(seeds[k : k + 1], [5, 7]).numpy()
        assert np.array_equal(stacked[5 * k : 5 * (k + 1)], alone)  # integer hashes: exactly
        # A fold's batch padded (stacked folds pad a short last batch) starts with the same numbers.
        assert np.array_equal(counter_uniform(seeds[k : k + 1], [9, 7]).numpy()[:5], alone)
        # Normals go through log and cos, whose kernels may round a tensor's tail otherwise.
        alone_normals = counter_normal(seeds[k : k + 1], [5, 7]).numpy()
        np.testing.assert_allclose(stacked_normals[5 * k : 5 * (k + 1)], alone_normals, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(
            counter_normal(seeds[k : k + 1], [9, 7]).numpy()[:5], alone_normals, rtol=1e-6, atol=1e-6
        )
    assert np.array_equal(stacked, counter_uniform(seeds, [15, 7]).numpy())
    assert np.array_equal(stacked_normals, counter_normal(seeds, [15, 7]).numpy())


def test_xla_compiles_the_draws_without_a_random_number_generator():
    keras.utils.set_random_seed(3)
    layer = keras.layers.Dropout(0.5)

    @tf.function(jit_compile=True)
    def step(x):
        with counter_draws():
            return layer(x, training=True)

    hlo = step.experimental_get_compiler_ir(tf.constant(ROWS))(stage="optimized_hlo")
    # The hash's integer ops, fused with the mask's select; no random number generator of XLA's.
    assert not re.search(r"= \S+ rng", hlo) and "u32" in hlo and "fusion" in hlo
    first, second = step(tf.constant(ROWS)).numpy(), step(tf.constant(ROWS)).numpy()
    assert not np.array_equal(first, second)  # the generator advanced between steps
    keras.utils.set_random_seed(3)
    again = keras.layers.Dropout(0.5)
    assert np.array_equal(drawn(again), first)  # under XLA or not, the same numbers from the same seed


def test_a_step_traced_for_batches_of_any_length_draws_what_one_traced_for_its_batch_draws():
    """The engine traces its step with the batch unknown, as Keras' fit does: the draws' shape is
    then known only when the step runs, and they are the numbers of a step traced for that batch
    size, under XLA or not (the hash of element i does not depend on how the shape was known)."""
    x = tf.constant(np.ones((37, 8, 6), np.float32))
    for jit_compile in (False, True):
        drawn_by = {}
        for batch in (None, 37):
            keras.utils.set_random_seed(5)
            layers = [
                keras.layers.Dropout(0.5),
                keras.layers.Dropout(0.5, noise_shape=(None, 1, 6)),
                keras.layers.GaussianNoise(0.5),
            ]

            @tf.function(input_signature=[tf.TensorSpec([batch, 8, 6])], jit_compile=jit_compile)
            def step(x, layers=layers):
                with counter_draws():
                    return [layer(x, training=True) for layer in layers]

            drawn_by[batch] = [np.asarray(outputs) for outputs in step(x)]
        unknown, known = drawn_by[None], drawn_by[37]
        assert np.array_equal(unknown[0], known[0]) and np.array_equal(unknown[1], known[1])
        assert 0 < (unknown[0] == 0).mean() < 1 and (unknown[1] == unknown[1][:, :1]).all()
        np.testing.assert_allclose(unknown[2], known[2], rtol=1e-6, atol=1e-6)
        assert unknown[2].std() > 0.1


def test_other_seeds_keep_keras_own_draws():
    keras.utils.set_random_seed(4)
    with counter_draws():
        explicit = keras.random.uniform((4,), seed=7)
    assert np.array_equal(explicit, keras.random.uniform((4,), seed=7))


def test_the_augmentation_layers_draw_per_image_from_keras_distributions_and_nothing_at_validation():
    """RandomFlip, RandomBrightness and RandomContrast draw one number per image, RandomCrop one
    window per batch, as Keras' own do; the numbers are foldsweep's, their distributions Keras'."""
    keras.utils.set_random_seed(6)
    rng = np.random.default_rng(0)
    images = rng.uniform(100.0, 150.0, size=(512, 4, 4, 3)).astype(np.float32)
    flip = keras.layers.RandomFlip("horizontal")
    start = np.asarray(flip.generator.state).copy()
    for out in (drawn(flip, images), np.asarray(flip(images, training=True))):  # ours, then Keras'
        flipped = np.all(out == images[:, :, ::-1], axis=(1, 2, 3))
        assert np.all(flipped | np.all(out == images, axis=(1, 2, 3)))  # each image whole, flipped or not
        assert abs(flipped.mean() - 0.5) < 0.07  # 512 fair coins: standard deviation 0.022
    assert np.asarray(flip.generator.state)[1] > start[1]
    assert np.array_equal(drawn(flip, images, training=False), images)

    def per_image_statistics(layer, measure):
        ours, keras_own = drawn(layer, images), np.asarray(layer(images, training=True))
        assert np.array_equal(drawn(layer, images, training=False), images)
        return measure(ours), measure(keras_own)

    # A brightness shift per image, uniform on +-0.2 of the value range (255): sd 0.2 * 255 / sqrt(3).
    bright = keras.layers.RandomBrightness(0.2)
    for delta in per_image_statistics(bright, lambda out: (out - images).mean(axis=(1, 2, 3))):
        assert abs(delta.mean()) < 4.0 and abs(delta.std() - 0.2 * 255 / np.sqrt(3)) < 3.0
    # A contrast factor per image (each channel's mean kept): RandomContrast(0.4) draws it uniform
    # on [1, 1.4] in this Keras (its factor's bounds are (0, 0.4)): mean 1.2, sd 0.4 / sqrt(12).
    contrast = keras.layers.RandomContrast(0.4)
    for factor in per_image_statistics(contrast, lambda out: out.std(axis=(1, 2)) / images.std(axis=(1, 2))):
        assert abs(factor.mean() - 1.2) < 0.02 and abs(factor.std() - 0.4 / np.sqrt(12)) < 0.02
    crop = keras.layers.RandomCrop(2, 3)
    windows = {(i, j): images[:, i : i + 2, j : j + 3] for i in range(3) for j in range(2)}
    offsets = set()
    for _ in range(30):
        out = drawn(crop, images)
        offsets |= {offset for offset, window in windows.items() if np.array_equal(out, window)}
    assert len(offsets) >= 4  # one window for the whole batch, a different one from step to step


@pytest.mark.parametrize(
    "make_layer",
    [
        lambda: keras.layers.RandomRotation(0.15),
        lambda: keras.layers.RandomTranslation(0.2, (-0.1, 0.3), fill_mode="constant"),
        lambda: keras.layers.RandomZoom((-0.3, 0.2), fill_mode="nearest"),
    ],
    ids=["RandomRotation", "RandomTranslation", "RandomZoom"],
)
def test_the_affine_augmentations_move_images_as_far_as_keras_own_and_not_at_validation(make_layer):
    """A rotation, shift or zoom per image, from Keras' distributions: how far each image moves
    (its mean change, on smooth images) is distributed as under Keras' own draws and transform."""
    keras.utils.set_random_seed(7)
    rows, columns = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    phases = np.random.default_rng(0).uniform(0, 2 * np.pi, size=(1024, 1, 1))
    images = np.sin(0.4 * rows + 0.3 * columns + phases)[..., np.newaxis].astype(np.float32)
    layer = make_layer()
    ours, keras_own = drawn(layer, images), np.asarray(layer(images, training=True))
    assert np.array_equal(drawn(layer, images, training=False), images)
    moved = [np.abs(out - images).mean(axis=(1, 2, 3)) for out in (ours, keras_own)]
    assert (moved[0] > 1e-3).mean() > 0.9  # each image its own transform
    spread = moved[1].std() / np.sqrt(len(images))
    assert abs(moved[0].mean() - moved[1].mean()) < 5 * spread
    assert abs(moved[0].std() / moved[1].std() - 1) < 0.1
    for quantile in (0.1, 0.5, 0.9):
        assert (
            abs(np.quantile(moved[0], quantile) - np.quantile(moved[1], quantile)) < 0.1 * moved[1].std() + 5 * spread
        )
