"""Two traced functions are one program when their graphs agree node for node, names aside:
what lets a trial's folds run the first fold's training step."""

import numpy as np
import pytest

from pipeline.engine.graph_identity import same_program


def _traced(scale=1.0, seed=1, branch_constant=2.0, name="dense"):
    """A step-like function over a variable of its own, traced: a constant (``scale``), a random
    op's seed (an attribute) and a tf.cond branch's constant (``branch_constant``) to vary."""
    import tensorflow as tf

    with tf.name_scope(name):
        variable = tf.Variable(np.ones((3, 2), np.float32), name=f"{name}_kernel")

    def step(x):
        y = tf.matmul(x, variable) * np.float32(scale)
        y = y + tf.random.uniform(tf.shape(y), seed=seed)
        y = tf.cond(tf.reduce_sum(y) > 0, lambda: y * np.float32(branch_constant), lambda: y)
        variable.assign_add(tf.ones_like(variable))
        return tf.reduce_sum(y)

    return tf.function(step, input_signature=[tf.TensorSpec([None, 3], tf.float32)]).get_concrete_function()


def test_one_step_traced_twice_on_other_variables_and_names_is_one_program():
    first, second = _traced(name="dense"), _traced(name="dense_7")
    assert first.graph.as_graph_def() != second.graph.as_graph_def()  # names differ
    assert same_program(first, second)


@pytest.mark.parametrize(
    "other",
    [
        {"scale": 1.5},  # a constant the build drew
        {"seed": 2},  # a number in an op's attributes
        {"branch_constant": 3.0},  # a constant inside a called function
    ],
    ids=["constant", "seed", "inside a branch"],
)
def test_a_number_of_its_own_makes_another_program(other):
    assert not same_program(_traced(), _traced(**other))


def test_a_gradient_computed_in_python_is_found_in_the_graph_or_a_function_it_calls():
    """An op whose gradient a Python function computes is what a forward graph does not show."""
    import tensorflow as tf

    from pipeline.engine.graph_identity import python_gradients

    @tf.custom_gradient
    def doubled_gradient(x):
        return tf.identity(x), lambda upstream: upstream * 2.0

    inner = tf.function(lambda x: doubled_gradient(x) * 3.0)
    spec = [tf.TensorSpec([None], tf.float32)]
    assert python_gradients(tf.function(lambda x: doubled_gradient(x), input_signature=spec).get_concrete_function())
    assert python_gradients(tf.function(lambda x: inner(x) + 1.0, input_signature=spec).get_concrete_function())
    assert not python_gradients(_traced())
