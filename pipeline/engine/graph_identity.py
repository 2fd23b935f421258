"""Whether two traced TensorFlow functions are one program, whatever their names.

Two fold models of a trial are one ``build(hp)`` under two seeds: their training steps trace to
the same graph but for the names TensorFlow and Keras hand out (a layer's ``conv2d_3`` against
``conv2d_7``, a function's counter) and for what each captures (its own variables). A graph in
which every node has the same op, attributes, constant values, device and inputs as the other's
node at the same position, with every function it calls the same in that sense, computes the same
numbers from the same captures: one can run in the other's place. A number a build draws and keeps
outside its variables (a NumPy array, an integer seed) is a constant or an attribute, and so a
difference.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pipeline.base.tensorflow_private import GRADIENT_OP_TYPE

# Attributes that name rather than compute: the colocation of a node with another (by its name),
# and the registry name of a custom gradient (new in every trace), which only differentiating the
# function looks up. A training step is called, never differentiated; a forward pass that is
# differentiated is compared only where it holds no custom gradient (``python_gradients``).
NAMING_ATTRIBUTES = frozenset({"_class", GRADIENT_OP_TYPE})

Canonical = tuple[Any, ...]


def same_program(first: Any, second: Any) -> bool:
    """Whether two traced functions (``ConcreteFunction``) compute the same from the same inputs
    and captures, each taken at its position: their graphs node for node (``canonical_form``)."""
    return canonical_form(first) == canonical_form(second)


def python_gradients(concrete: Any) -> bool:
    """Whether a traced function holds an op whose gradient a Python function computes
    (``tf.custom_gradient``, a gradient override): its forward graph does not say what its
    gradient computes, where every other op's gradient follows from the op."""
    graph_def = concrete.graph.as_graph_def()
    bodies = [graph_def.node, *(function.node_def for function in graph_def.library.function)]
    return any(GRADIENT_OP_TYPE in node.attr for body in bodies for node in body)


def canonical_form(concrete: Any) -> Canonical:
    """A traced function's graph with every name replaced by the position of what it names: its
    nodes in order (op, inputs by position, attributes, device), the functions they call in the
    same form."""
    graph_def = concrete.graph.as_graph_def()
    library = {function.signature.name: function for function in graph_def.library.function}
    return _nodes(graph_def.node, (), library, {})


def _nodes(nodes: Iterable[Any], arguments: Iterable[str], library: Mapping[str, Any], done: dict) -> Canonical:
    nodes = list(nodes)
    position: dict[str, tuple[str, int]] = {name: ("argument", i) for i, name in enumerate(arguments)}
    position.update({node.name: ("node", i) for i, node in enumerate(nodes)})
    form = []
    for node in nodes:
        inputs = []
        for text in node.input:
            # "name", "name:k" (a graph), "name:output:k" (a function body) or "^name" (control).
            source, _, output = text.lstrip("^").partition(":")
            inputs.append((text.startswith("^"), position.get(source, ("outside", source)), output))
        attributes = tuple(
            sorted(
                (key, _attribute(value, library, done))
                for key, value in node.attr.items()
                if key not in NAMING_ATTRIBUTES
            )
        )
        form.append((node.op, tuple(inputs), attributes, node.device))
    return tuple(form)


def _attribute(value: Any, library: Mapping[str, Any], done: dict) -> Any:
    kind = value.WhichOneof("value")
    if kind == "func":
        return ("func", _function(value.func.name, library, done), _attributes(value.func.attr, library, done))
    if kind == "list" and value.list.func:
        return ("funcs", tuple(_function(function.name, library, done) for function in value.list.func))
    return (kind, value.SerializeToString(deterministic=True))


def _attributes(attributes: Mapping[str, Any], library: Mapping[str, Any], done: dict) -> Canonical:
    return tuple(sorted((key, _attribute(value, library, done)) for key, value in attributes.items()))


def _function(name: str, library: Mapping[str, Any], done: dict) -> Any:
    """A called function's canonical form, by its name in the graph's library (a function outside
    it, registered process-wide, by its name); each worked out once."""
    if name not in done:
        definition = library.get(name)
        if definition is None:
            done[name] = ("registered", name)
        else:
            done[name] = ("recursive", name)  # a function calling itself ends here
            signature = definition.signature
            body = list(definition.node_def)
            position = {node.name: i for i, node in enumerate(body)}
            returned = []
            for output in signature.output_arg:
                source, _, rest = definition.ret[output.name].partition(":")
                returned.append((position.get(source, source), rest))
            done[name] = (
                tuple(argument.SerializeToString(deterministic=True) for argument in _unnamed(signature.input_arg)),
                tuple(argument.SerializeToString(deterministic=True) for argument in _unnamed(signature.output_arg)),
                _nodes(body, (argument.name for argument in signature.input_arg), library, done),
                tuple(returned),
                _attributes(definition.attr, library, done),
            )
    return done[name]


def _unnamed(arguments: Iterable[Any]) -> list[Any]:
    """A signature's arguments without their names (their types and how many)."""
    copies = []
    for argument in arguments:
        copy = type(argument)()
        copy.CopyFrom(argument)
        copy.name = ""
        copy.description = ""
        copies.append(copy)
    return copies
