"""Whether XLA can compile a model's training step: every op its forward pass runs in training
has an XLA kernel.

Some of Keras' own layers run ops XLA has none for: RandomTranslation, RandomRotation, RandomZoom,
RandomShear and RandomPerspective transform images with ImageProjectiveTransformV3; MixUp,
CutMix and AugMix draw from a gamma distribution (StatelessRandomGammaV3); a researcher's layer
may call anything. A step XLA is asked to compile with such an op fails when it is first called,
on a GPU (where foldsweep compiles with XLA) as on a CPU with ``train.jit_compile: true``. Rather
than keep a list of such layers, the forward pass is traced (not run) and its ops are looked up in
TensorFlow's kernel registry, which lists the XLA devices an op compiles for.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

from pipeline.base.private_hooks import has_xla_kernel

# The ops of a traced function that are not computations: its inputs (arguments and captured
# variables), which XLA takes as parameters.
_NOT_COMPUTED = frozenset({"Placeholder"})
# Keras' layers that are known to run only ops with XLA kernels need no trace: of Keras' own, only
# the preprocessing layers run ops outside the math of a network.
_PREPROCESSING_MODULE = "keras.src.layers.preprocessing."


def xla_blocker(model: Any, input_shape: Sequence[int]) -> str | None:
    """Why XLA cannot compile ``model``'s training step on samples of ``input_shape``, naming the
    layer and the op, or None. Only a preprocessing layer or a layer that is not Keras' own is
    traced, alone on its inputs where the model's layer graph gives them (a Functional or
    Sequential model, nested ones too); a subclassed model's whole forward pass is traced; a
    model with neither (a keras.applications backbone) is not traced at all."""
    import tensorflow as tf

    layers = list(model._flatten_layers(include_self=False, recursive=True))
    suspects = [layer for layer in layers if _may_run_other_ops(layer)]
    subclassed = _may_run_other_ops(model)
    if not suspects and not subclassed:
        return None
    inputs = [_input_specs(layer) for layer in suspects]
    if subclassed or any(specs is None for specs in inputs):
        traced = [(model, [tf.TensorSpec((None, *input_shape), tf.float32)])]
    else:
        traced = list(zip(suspects, inputs))
    for called, specs in traced:
        function = tf.function(lambda *x, called=called: called(x[0] if len(x) == 1 else list(x), training=True))
        for op, name in _ops(function.get_concrete_function(*specs).graph.as_graph_def()):
            if op not in _NOT_COMPUTED and not has_xla_kernel(op):
                culprit = _layer_of(name, layers) if called is model else _named(called)
                return f"{culprit} runs {op}, an op XLA has no kernel for"
    return None


def _input_specs(layer: Any) -> list[Any] | None:
    """The shapes and dtypes of what a layer is called on in its model's layer graph, or None (a
    subclassed model's layer, or one called at several places)."""
    import tensorflow as tf

    try:
        tensors = tf.nest.flatten(layer.input)
    except (AttributeError, ValueError):
        return None
    return [tf.TensorSpec(tensor.shape, tensor.dtype) for tensor in tensors] or None


def _may_run_other_ops(layer: Any) -> bool:
    module = type(layer).__module__
    return module.startswith(_PREPROCESSING_MODULE) or not module.startswith("keras.")


def _ops(graph_def: Any) -> Iterator[tuple[str, str]]:
    """(op type, node name) of every node of a traced graph and of the functions it calls."""
    for node in graph_def.node:
        yield node.op, node.name
    for function in graph_def.library.function:
        for node in function.node_def:
            yield node.op, node.name


def _layer_of(node_name: str, layers: Sequence[Any]) -> str:
    """The layer whose name scope holds a node ("sequential_1/random_rotation_1/Op": TensorFlow
    numbers a scope it has seen before), as the message names it."""
    by_name = {layer.name: layer for layer in layers}
    for scope in reversed(node_name.split("/")[:-1]):
        layer = by_name.get(scope) or by_name.get(re.sub(r"_\d+$", "", scope))
        if layer is not None:
            return _named(layer)
    return "the model"


def _named(layer: Any) -> str:
    return f"layer {layer.name!r} ({type(layer).__name__})"
