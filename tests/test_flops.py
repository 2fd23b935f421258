"""The benchmark's FLOP count from a model's layers, against TensorFlow's graph profiler."""

import pytest

from benchmarks.common import cnn_builder
from benchmarks.cv_throughput import REPO
from benchmarks.flops import profiled_forward_flops, training_flops_per_sample
from pipeline.contract.compile_cost import multiply_adds
from pipeline.inputs.hypermodel import build_model, load_builder


def image_convolutions(hp):
    import keras

    return keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(8, 3, padding="same", use_bias=False),
            keras.layers.DepthwiseConv2D(3, depth_multiplier=2, use_bias=False),
            keras.layers.SeparableConv2D(12, 3, strides=2, use_bias=False),
            keras.layers.Conv2DTranspose(4, 3, strides=2, use_bias=False),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(5, use_bias=False),
        ]
    )


@pytest.mark.parametrize(
    "name, build, values",
    [
        ("protein_cnn", load_builder(REPO / "experiments" / "protein_cnn.py", "build"), {}),
        (
            "protein_cnn filters 32, 3 layers",
            load_builder(REPO / "experiments" / "protein_cnn.py", "build"),
            {"filters": 32, "conv_layers": 3, "kernel_size": 7},
        ),
        ("plain CNN on MNIST-1D", cnn_builder((40, 1), 10), {}),
        ("depthwise, separable and transposed 2-D convolutions", image_convolutions, {}),
    ],
)
def test_the_layers_count_agrees_with_tensorflows_profiler(name, build, values):
    model = build_model(build, values)
    counted = 2 * multiply_adds(model)
    profiled = profiled_forward_flops(model)
    # the profiler also counts biases, activations and pooling, which the layers' count leaves out
    assert counted <= profiled <= 1.03 * counted, (name, counted, profiled)


def test_protein_cnn_at_its_defaults_costs_what_its_layers_say():
    model = build_model(load_builder(REPO / "experiments" / "protein_cnn.py", "build"), {})
    # conv 15x64x5x21 + conv 15x64x5x64 + dense 960x64 + dense 64x3
    assert multiply_adds(model) == 15 * 64 * 5 * 21 + 15 * 64 * 5 * 64 + 960 * 64 + 64 * 3
    assert training_flops_per_sample(model) == 6 * multiply_adds(model)


def test_a_sequential_without_input_and_a_subclassed_model_count_as_the_functional_one():
    import keras
    import numpy as np

    def stack():
        return [keras.layers.Conv1D(8, 3), keras.layers.MaxPooling1D(2), keras.layers.Flatten(), keras.layers.Dense(4)]

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.stack = stack()

        def call(self, x):
            for layer in self.stack:
                x = layer(x)
            return x

    functional = keras.Sequential([keras.Input((40, 2)), *stack()])
    without_input = keras.Sequential(stack())
    without_input.build((None, 40, 2))
    subclassed = Subclassed()
    subclassed(np.zeros((1, 40, 2), "float32"))
    # a valid convolution's 38 positions x 8 filters x width 3 x 2 channels, then 19 x 8 inputs x 4 units
    expected = 38 * 8 * 3 * 2 + 19 * 8 * 4
    assert multiply_adds(functional) == multiply_adds(without_input) == multiply_adds(subclassed) == expected
    assert multiply_adds(keras.Sequential(stack())) == 0  # not built: no shapes to count


def test_grouped_channels_first_and_3d_convolutions_count_their_own_shapes():
    import keras

    grouped = keras.Sequential(
        [keras.Input((4, 10)), keras.layers.Conv1D(6, 3, groups=2, data_format="channels_first")]
    )
    # 8 positions x 6 filters x width 3 x 2 of the 4 channels per group
    assert multiply_adds(grouped) == 8 * 6 * 3 * 2
    volume = keras.Sequential([keras.Input((4, 4, 4, 2)), keras.layers.Conv3D(3, 2)])
    assert multiply_adds(volume) == 27 * 3 * 8 * 2
    # a length left unknown counts nothing
    assert multiply_adds(keras.Sequential([keras.Input((None, 2)), keras.layers.Conv1D(4, 3)])) == 0
