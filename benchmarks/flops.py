"""How far from the machine's limit a variant runs: a model's training FLOPs per sample, and the
float32 FLOP/s the same threads reach on a large matmul (the peak a CNN step is compared with).

FLOPs are counted from the model's layers: a convolution or a dense layer's forward pass costs two
FLOPs per multiply-add (as the plan counts them, ``pipeline.contract.compile_cost.multiply_adds``),
and its training step about three forward passes (the forward, the gradient of its input, the
gradient of its weights). ``profiled_forward_flops`` asks TensorFlow's own graph profiler for
the forward pass (``tests/test_flops.py`` checks that the two agree), which counts every op but
sees only a traced graph.
"""

from __future__ import annotations

import time
from typing import Any

import keras

from pipeline.contract.compile_cost import multiply_adds

# The forward pass, the gradient of the layer's input and the gradient of its weights.
TRAINING_PASSES = 3
PEAK_MATMUL_SIZE = 1024
PEAK_CHAIN = 8  # matmuls per launch, so that launching costs nothing beside them


def training_flops_per_sample(model: keras.Model) -> float:
    """FLOPs of one sample's training step (forward and backward), from its layers."""
    return float(2 * TRAINING_PASSES * multiply_adds(model))


def profiled_forward_flops(model: keras.Model) -> int:
    """TensorFlow's graph profiler's count of one sample's forward pass (every op it knows)."""
    import tensorflow as tf
    from tensorflow.python.profiler import model_analyzer, option_builder

    graph = (
        tf.function(lambda x: model(x, training=False))
        .get_concrete_function(tf.TensorSpec([1, *model.input_shape[1:]], tf.float32))
        .graph
    )
    options = {**option_builder.ProfileOptionBuilder.float_operation(), "output": "none"}
    return int(model_analyzer.profile(graph, options=options).total_float_ops)


def matmul_peak_flops(*, seconds: float = 2.0) -> float:
    """The float32 FLOP/s an XLA-compiled chain of large matmuls reaches on this process's
    TensorFlow threads (set them first): the best of several timed launches."""
    import tensorflow as tf

    n = PEAK_MATMUL_SIZE
    a = tf.random.stateless_normal([n, n], seed=(0, 1))
    b = tf.random.stateless_normal([n, n], seed=(0, 2)) / n

    @tf.function(jit_compile=True)
    def chain(c: Any, b: Any) -> Any:
        for _ in range(PEAK_CHAIN):
            c = tf.matmul(c, b)
        return c

    chain(a, b).numpy()  # compile
    flops, best = 2 * n**3 * PEAK_CHAIN, 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        chain(a, b).numpy()
        best = max(best, flops / (time.perf_counter() - started))
    return best
