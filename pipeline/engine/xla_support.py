"""Whether XLA can compile a model's training step: every op its forward pass runs in training
has an XLA kernel, and XLA lowers each layer that may run other ops than a network's math.

Some of Keras' own layers run ops XLA has none for: RandomTranslation, RandomRotation, RandomZoom,
RandomShear and RandomPerspective transform images with ImageProjectiveTransformV3 (the first three
with ops XLA compiles where foldsweep draws their numbers); MixUp,
CutMix and AugMix draw from a gamma distribution (StatelessRandomGammaV3); a researcher's layer
may call anything. A step XLA is asked to compile with such an op fails when it is first called,
on a GPU (where foldsweep compiles with XLA) as on a CPU with ``train.jit_compile: true``. Rather
than keep a list of such layers, the forward pass is traced (not run) and its ops are looked up in
TensorFlow's kernel registry, which lists the XLA devices an op compiles for; and since an op XLA
has a kernel for may still need what XLA cannot give it (RandomElasticTransform's Range needs a
length known when it compiles), each such layer is also lowered by XLA alone, not run.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from pipeline.base.keras_private import flatten_layers, is_preprocessing_layer
from pipeline.base.tensorflow_private import has_xla_kernel
from pipeline.engine import draws

# The ops of a traced function that are not computations: its inputs (arguments and captured
# variables), which XLA takes as parameters.
_NOT_COMPUTED = frozenset({"Placeholder"})
# The batch a layer is lowered on (XLA lowers static shapes only).
_LOWERED_BATCH = 2
_NO_KERNEL = "an op XLA has no kernel for"


def xla_blocker(model: Any, input_shape: Sequence[int], *, counter_draws: bool = False) -> str | None:
    """Why XLA cannot compile ``model``'s training step on samples of ``input_shape``, naming the
    layer and the op, or None; with ``counter_draws`` as the step draws foldsweep's numbers
    (``pipeline.engine.draws``, whose affine image transform XLA compiles). Only a preprocessing
    layer or a layer that is not Keras' own is traced, alone on its inputs where the model's layer
    graph gives them (a Functional or Sequential model, nested ones too); a subclassed model's whole
    forward pass is traced, as is a model with a layer that cannot be called alone so; a model with
    neither kind of layer (a keras.applications backbone) is not traced at all."""
    with draws.counter_draws(under_xla=True) if counter_draws else contextlib.nullcontext():
        return _blocker(model, input_shape)


def _blocker(model: Any, input_shape: Sequence[int]) -> str | None:
    import tensorflow as tf

    layers = flatten_layers(model, include_self=False)
    suspects = [layer for layer in layers if _may_run_other_ops(layer)]
    if not suspects and not _may_run_other_ops(model):
        return None
    inputs = [specs for layer in suspects if (specs := _input_specs(layer)) is not None]
    if not _may_run_other_ops(model) and len(inputs) == len(suspects):
        try:
            return _first_blocker(zip(suspects, inputs))
        except _NotCallableAlone:
            pass
    graph = _traced(model).get_concrete_function(tf.TensorSpec((None, *input_shape), tf.float32)).graph
    found = _unkerneled(graph)
    return None if found is None else f"{_layer_of(found[1], layers)} runs {found[0]}, {_NO_KERNEL}"


class _NotCallableAlone(Exception):
    """A layer could not be traced alone on its inputs (it takes them otherwise than as one
    tensor or a list)."""


def _first_blocker(layers_and_inputs: Iterable[tuple[Any, list[Any]]]) -> str | None:
    for layer, specs in layers_and_inputs:
        try:
            graph = _traced(layer).get_concrete_function(*specs).graph
        except Exception as exc:
            raise _NotCallableAlone from exc
        found = _unkerneled(graph)
        if found is not None:
            return f"{_named(layer)} runs {found[0]}, {_NO_KERNEL}"
        refusal = _lowering_refusal(layer, specs)
        if refusal is not None:
            return f"{_named(layer)} does not compile under XLA: {refusal}"
    return None


def _traced(called: Any, *, jit_compile: bool | None = None) -> Any:
    """``called`` in training, as a function of its inputs (one tensor, or several as a list)."""
    import tensorflow as tf

    return tf.function(
        lambda *x: called(x[0] if len(x) == 1 else list(x), training=True), jit_compile=jit_compile, autograph=False
    )


def _unkerneled(graph: Any) -> tuple[str, str] | None:
    """(op type, node name) of the first op of a traced graph XLA has no kernel for."""
    return next(
        ((op, name) for op, name in _ops(graph.as_graph_def()) if op not in _NOT_COMPUTED and not has_xla_kernel(op)),
        None,
    )


def _lowering_refusal(layer: Any, specs: Sequence[Any]) -> str | None:
    """What XLA says when it lowers a layer alone on a batch of 2 (an op whose every kernel it has
    can still need what XLA cannot give it, as RandomElasticTransform's Range needs a constant
    length), or None; not asked of a layer whose inputs have other unknown sizes."""
    import tensorflow as tf

    if any(None in spec.shape[1:] for spec in specs):
        return None
    fixed = [tf.TensorSpec((_LOWERED_BATCH, *spec.shape[1:]), spec.dtype) for spec in specs]
    try:
        _traced(layer, jit_compile=True).experimental_get_compiler_ir(*fixed)(stage="hlo")
    except Exception as exc:  # tf2xla's refusal, as a ValueError or InvalidArgumentError
        text = str(exc).removeprefix("Failed getting HLO text: ").strip("'\" ")
        return text.splitlines()[0] if text else type(exc).__name__
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
    """Keras' layers that are known to run only ops with XLA kernels need no trace: of Keras' own,
    only the preprocessing layers run ops outside the math of a network."""
    return is_preprocessing_layer(layer) or not type(layer).__module__.startswith("keras.")


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
