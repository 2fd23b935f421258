"""Whether XLA can compile a model's training step (pipeline.engine.xla_support): Keras' layers
whose ops XLA has no kernel for, and a researcher's own, found by tracing the forward pass and
named; models XLA compiles pass, and indeed compile."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from pipeline.engine.xla_support import xla_blocker

pytestmark = pytest.mark.training  # traces models

SHAPE = (8, 8, 3)


class OwnClip(keras.layers.Layer):
    """A researcher's layer that computes in NumPy: a PyFunc op, which XLA cannot compile."""

    def call(self, x):
        return tf.ensure_shape(tf.numpy_function(lambda v: np.clip(v, -1, 1), [x], tf.float32), x.shape)


def built(*layers):
    model = keras.Sequential([*layers, keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
    model.build((None, *SHAPE))
    return model


@pytest.mark.parametrize(
    "make_layer, named",
    [
        (
            lambda: keras.layers.RandomRotation(0.1, name="tilt"),
            "layer 'tilt' (RandomRotation) runs ImageProjectiveTransformV3",
        ),
        (
            lambda: keras.Sequential([keras.layers.RandomFlip(), keras.layers.RandomZoom(0.1, name="zoom")]),
            "layer 'zoom' (RandomZoom) runs ImageProjectiveTransformV3",
        ),
        (lambda: OwnClip(name="clip"), "layer 'clip' (OwnClip) runs PyFunc"),
    ],
    ids=["RandomRotation", "nested RandomZoom", "own layer"],
)
def test_a_layer_whose_op_xla_cannot_compile_is_named_with_its_op(make_layer, named):
    assert xla_blocker(built(make_layer()), SHAPE) == f"{named}, an op XLA has no kernel for"


def test_the_affine_augmentations_compile_where_foldsweep_draws_their_numbers():
    """RandomRotation, RandomTranslation and RandomZoom transform images with an op XLA has no
    kernel for, which foldsweep replaces while it draws (``pipeline.engine.image_transforms``)."""
    from pipeline.engine.draws import counter_draws

    augmented = built(
        keras.layers.RandomRotation(0.1),
        keras.Sequential([keras.layers.RandomTranslation(0.1, 0.1), keras.layers.RandomZoom(0.1)]),
    )
    assert xla_blocker(augmented, SHAPE, counter_draws=True) is None
    assert "(RandomRotation) runs ImageProjectiveTransformV3" in xla_blocker(augmented, SHAPE)

    @tf.function(jit_compile=True)
    def step(x):
        with counter_draws(under_xla=True):
            return augmented(x, training=True)

    assert step(np.ones((2, *SHAPE), np.float32)).shape == (2, 2)


def test_a_layer_whose_ops_all_have_kernels_but_do_not_lower_is_named_with_what_xla_says():
    message = xla_blocker(built(keras.layers.RandomElasticTransform(name="warp")), SHAPE)
    assert re.fullmatch(
        r"layer 'warp' \(RandomElasticTransform\) does not compile under XLA: Input 1 to node `\S*range` with op "
        r"Range must be a compile-time constant\.?",
        message,
    ), message


def test_models_xla_compiles_pass_and_compile():
    augmented = built(
        keras.layers.RandomFlip(),
        keras.layers.RandomContrast(0.2),
        keras.layers.Conv2D(4, 3),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.2),
    )
    assert xla_blocker(augmented, SHAPE) is None
    step = tf.function(lambda x: augmented(x, training=True), jit_compile=True)
    assert step(np.ones((2, *SHAPE), np.float32)).shape == (2, 2)
    assert xla_blocker(built(keras.layers.Conv2D(4, 3)), SHAPE) is None


def test_a_subclassed_model_is_traced_whole_and_its_layer_named():
    class Tilted(keras.Model):
        def __init__(self):
            super().__init__()
            self.tilt = keras.layers.RandomRotation(0.1, name="tilt")
            self.head = keras.layers.Dense(2)

        def call(self, x, training=False):
            return self.head(keras.ops.mean(self.tilt(x, training=training), axis=(1, 2)))

    model = Tilted()
    model(np.ones((1, *SHAPE), np.float32))
    assert xla_blocker(model, SHAPE) == (
        "layer 'tilt' (RandomRotation) runs ImageProjectiveTransformV3, an op XLA has no kernel for"
    )


def test_a_layer_of_two_inputs_is_traced_within_the_whole_model():
    class Blend(keras.layers.Layer):
        def call(self, a, b):
            return 0.5 * (a + b)

    inputs = keras.Input(SHAPE)
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(Blend()(inputs, inputs)))
    assert xla_blocker(keras.Model(inputs, outputs), SHAPE) is None
