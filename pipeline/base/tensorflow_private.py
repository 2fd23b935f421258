"""Every place foldsweep reaches into TensorFlow's private API (``tensorflow.python``,
``tensorflow.core`` and ``tensorflow.tsl``, and private names of TensorFlow's objects), each a
small function: no other module of foldsweep touches a private name of TensorFlow
(``tests/test_private_hooks.py`` checks it).

What each gives users, and the check that it still holds on the installed TensorFlow, is its hook
in ``pipeline.base.private_hooks``. TensorFlow is imported inside the functions: the base layer
loads as every command starts, TensorFlow only where a command trains.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

# The attribute tf.function(jit_compile=True) gives its functions, and compile_call one call.
XLA_MUST_COMPILE = "_XlaMustCompile"
# The node attribute in which tf.custom_gradient records its gradient's registry name.
GRADIENT_OP_TYPE = "_gradient_op_type"
# The prefix of the registry names tf.custom_gradient gives its gradient functions.
CUSTOM_GRADIENT_PREFIX = "CustomGradient-"


# -- the process's TensorFlow ---------------------------------------------------------------------


def devices_set_up() -> bool:
    """Whether this process's TensorFlow has listed or set up its devices, when it read its XLA
    flags: a flag set after that is ignored."""
    from tensorflow.python.eager import context

    state = context.context()
    return bool(state._initialized or state._physical_devices is not None)


def use_graph_optimizer(*, light: bool) -> None:
    """Have TensorFlow's graph optimizer (Grappler) work through each function this process
    instantiates from now on in one round without its MLIR (TFG) pipelines (``light``), or as
    TensorFlow does by default. Grappler reads its options from the configuration each function
    is called with (its function-call options), which each thread takes from the eager context's
    configuration as it first calls a function: tf.config exposes neither option."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.eager import context

    state = context.context()
    config = config_pb2.ConfigProto()
    if state._config is not None:
        config.CopyFrom(state._config)
    rewrite = config.graph_options.rewrite_options
    if light:
        rewrite.meta_optimizer_iterations = rewriter_config_pb2.RewriterConfig.ONE
        rewrite.disable_tfg_optimizer = True
    else:
        rewrite.ClearField("meta_optimizer_iterations")
        rewrite.ClearField("disable_tfg_optimizer")
    state._config = config
    state.function_call_options = None  # this thread's, taken again at its next call


def op_determinism_enabled() -> bool:
    """Whether ``tf.config.experimental.enable_op_determinism()`` was called: tf.config sets it,
    and exports no getter."""
    from tensorflow.python.framework import config

    return bool(config.is_op_determinism_enabled())


@functools.cache
def has_xla_kernel(op: str) -> bool:
    """Whether XLA can compile TensorFlow's op ``op`` (on some device): TensorFlow's kernel
    registry lists a kernel of it for an XLA JIT device (registered with the first eager tensor)."""
    import tensorflow as tf
    from tensorflow.python.framework import kernels

    tf.constant(0.0)
    return any(kernel.device_type.startswith("XLA_") for kernel in kernels.get_registered_kernels_for_op(op).kernel)


# -- traced functions -----------------------------------------------------------------------------


@contextlib.contextmanager
def traced_functions_named(rename: Callable[[Any, Any, Mapping[str, Any]], Any], captured_name: str) -> Iterator[None]:
    """While the block runs, every function TensorFlow traces (a step, a loop body, a cond branch)
    is defined under ``rename(name, graph, attrs)`` in place of the name TensorFlow gave it (its
    caller told, where it is nested), and what a called function captured reaches its caller as
    ``captured_name`` (numbered by appearance in the caller's graph: captured, captured_1, ...)
    instead of a name from a process-wide counter."""
    from tensorflow.core.function.capture import capture_container
    from tensorflow.python.eager.polymorphic_function import atomic_function
    from tensorflow.python.types import core

    original = atomic_function.from_func_graph
    original_capture = capture_container.FunctionCaptures.capture_by_value

    def from_func_graph(name: Any, graph: Any, *args: Any, **kwargs: Any) -> Any:
        attrs = kwargs.get("attrs", args[0] if args else None) or {}
        renamed = rename(name, graph, attrs)
        if graph.name == name:  # a nested function: its caller reads graph.name
            graph.name = renamed
        return original(renamed, graph, *args, **kwargs)

    def capture_by_value(self: Any, graph: Any, tensor: Any, name: str | None = None) -> Any:
        if name is None and isinstance(tensor, core.Value):
            name = captured_name
        return original_capture(self, graph, tensor, name)

    atomic_function.from_func_graph = from_func_graph
    capture_container.FunctionCaptures.capture_by_value = capture_by_value  # type: ignore[method-assign]
    try:
        yield
    finally:
        atomic_function.from_func_graph = original
        capture_container.FunctionCaptures.capture_by_value = original_capture  # type: ignore[method-assign]


def marked_for_xla(attrs: Mapping[str, Any]) -> bool:
    """Whether a traced function's attributes have XLA compile it (``XLA_MUST_COMPILE``: a bool,
    or an AttrValue)."""
    must_compile = attrs.get(XLA_MUST_COMPILE, False)
    return getattr(must_compile, "b", must_compile) is True


def mark_for_xla(call: Any) -> None:
    """Have XLA compile one call of a function (an operation of a graph being traced), as
    ``tf.function(jit_compile=True)`` has it compile the function."""
    from tensorflow.core.framework import attr_value_pb2

    call._set_attr(XLA_MUST_COMPILE, attr_value_pb2.AttrValue(b=True))


def gradient_names_numbered(graph: Any) -> Any:
    """A traced graph's GraphDef with its custom gradients' registry names
    (``CustomGradient-<counter>``, new in every trace) numbered by appearance."""
    graph_def = graph.as_graph_def()
    renumbered: dict[bytes, bytes] = {}
    for node in [*graph_def.node, *(node for function in graph_def.library.function for node in function.node_def)]:
        if GRADIENT_OP_TYPE in node.attr:
            value = node.attr[GRADIENT_OP_TYPE].s
            node.attr[GRADIENT_OP_TYPE].s = renumbered.setdefault(
                value, b"%s%d" % (CUSTOM_GRADIENT_PREFIX.encode(), len(renumbered))
            )
    return graph_def


def call_with_captures(concrete: Any, arguments: Sequence[Any], captures: list[Any]) -> Any:
    """Call a traced function (a ``ConcreteFunction``) on ``arguments`` with ``captures`` in place
    of what it captured, in its order."""
    return concrete._call_flat(list(arguments), captures)


# -- the gradient registry ------------------------------------------------------------------------


def registered_gradients() -> frozenset[str]:
    """The names in TensorFlow's gradient registry now."""
    from tensorflow.python.framework import ops

    return frozenset(ops.gradient_registry._registry)


def unregister_custom_gradients(before: frozenset[str]) -> int:
    """Drop the gradient functions ``tf.custom_gradient`` registered since ``registered_gradients``
    returned ``before``; returns how many."""
    from tensorflow.python.framework import ops

    registry = ops.gradient_registry._registry
    added = [name for name in registry if name.startswith(CUSTOM_GRADIENT_PREFIX) and name not in before]
    for name in added:
        del registry[name]
    return len(added)


# -- the profiler ---------------------------------------------------------------------------------


def parsed_xspace(data: bytes) -> Any:
    """An XSpace (what TensorFlow's profiler writes, ``*.xplane.pb``) parsed with TensorFlow's own
    protocol buffer: the viewers'."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(data)
    return space
