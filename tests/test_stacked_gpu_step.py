"""The GPU plan's step, run and inspected on CPU (no GPU here): no host wait inside an epoch.

The plan a GPU gets (``stop_test: per_epoch``) is replayed on CPU through ``build_trainer``'s
``replay`` (a recorded plan is executed when deciding again comes to the same execution): its
traced epoch holds no tf.cond and no loop condition that reads the tally, and it trains every
fold exactly as the CPU plan's step does, a fold that goes NaN included."""

from __future__ import annotations

from dataclasses import replace

import keras
import numpy as np
import pytest
from helpers import MNIST1D_EXPERIMENT, mnist1d_fixtures
from run_machinery import between_trials

from pipeline.base.accelerator import GpuIdentity
from pipeline.contract.plan import ExecutionChoices
from pipeline.engine import trainer as trainer_module
from pipeline.engine.recipe import TrainingRecipe
from pipeline.engine.resident import resident_data
from pipeline.engine.stacked import (
    StackedFolds,
    StackedForm,
    forward_matches,
    forward_mismatch,
    forward_tolerance,
    stacked_weights,
)
from pipeline.engine.trainer import build_trainer
from pipeline.inputs.folds import Fold
from pipeline.inputs.hypermodel import load_builder

pytestmark = pytest.mark.training

CONFIG = {
    "conv_layers": 1,
    "filters": 8,
    "kernel_size": 3,
    "dropout": 0.0,
    "batch_size": 8,
    "learning_rate": 1e-3,
    "optimizer": "adam",
}
CONDITIONALS = {"If", "StatelessIf"}


dataset, folds = mnist1d_fixtures(410)


def trainer_for(data, folds, *, layout, steps_per_launch=1, per_epoch=False):
    """A trainer of the CPU plan, or of the same plan with the GPU's per-epoch stop test."""
    choices = ExecutionChoices(
        fused="off" if layout == "sequential" else "on",
        steps_per_launch=steps_per_launch,
        layout="auto" if layout == "sequential" else layout,
    )
    build = load_builder(MNIST1D_EXPERIMENT, "build")
    between_trials()
    trainer = build_trainer(build, CONFIG, TrainingRecipe(choices=choices), data=data, folds=folds)
    assert trainer.plan.layout == layout and trainer.plan.stop_test == "per_launch"
    if per_epoch:
        between_trials()
        trainer = build_trainer(
            build,
            CONFIG,
            TrainingRecipe(choices=choices),
            data=data,
            folds=folds,
            replay=replace(trainer.plan, stop_test="per_epoch"),
        )
        assert trainer.plan.stop_test == "per_epoch"
    return trainer


def with_stacked_executor(trainer, data, **options):
    """The trainer with its stacked folds executed in another form than its plan's (what a plan
    on CPU never asks for: the GPU's grouped convolutions, say)."""
    trainer._executor = StackedFolds(
        trainer.engines,
        trainer.params,
        data=data,
        loss=trainer.loss,
        optimizer=trainer.optimizer,
        steps_per_launch=trainer.plan.steps_per_launch,
        **options,
    )
    return trainer


def history(trainer, epochs=2):
    reports = [trainer.run_epoch().report() for _ in range(epochs)]
    keys = [
        key
        for key in reports[0]
        if key.startswith("split") and key.split("_", 1)[1] in ("train_loss", "val_loss", "val_accuracy")
    ]
    return {key: [report[key] for report in reports] for key in keys}


def epoch_graphs(trainer):
    """The traced epoch function(s) of a trained trainer's executor, as concrete functions."""
    executor = trainer._executor
    if trainer.plan.layout == "sequential":
        engine = trainer.engines[0]
        return [engine._train_epoch.get_concrete_function(*engine.epoch_batch_tensors(0))]
    if trainer.plan.layout == "side_by_side":
        return [
            function.get_concrete_function([engine.epoch_batch_tensors(0) for engine in trainer.engines])
            for function in executor._compiled.values()
        ]
    import tensorflow as tf

    live = tuple(range(len(trainer.engines)))
    indices, weights = executor.epoch_batches(0, live)
    return [
        executor._train_epoch.get_concrete_function(
            tf.constant(indices), tf.constant(weights), tf.constant(np.ones(len(live), bool))
        )
    ]


def host_waits(concrete) -> tuple[set[str], list[set[str]]]:
    """(conditional ops anywhere in the function and the functions it calls, the op types of
    every while loop's condition)."""
    graph = concrete.graph.as_graph_def()
    functions = {function.signature.name: function for function in graph.library.function}
    nodes = [*graph.node, *(node for function in functions.values() for node in function.node_def)]
    conditionals = {node.op for node in nodes if node.op in CONDITIONALS}
    loop_tests = [
        {node.op for node in functions[node.attr["cond"].func.name].node_def}
        for node in nodes
        if node.op in ("While", "StatelessWhile")
    ]
    return conditionals, loop_tests


@pytest.mark.parametrize("layout", ["sequential", "side_by_side", "stacked"])
def test_the_gpu_plans_epoch_holds_no_cond_and_no_loop_test_of_the_tally(dataset, folds, layout):
    data = resident_data("test-gpu-step", dataset.x, dataset.y)
    cpu = trainer_for(data, folds, layout=layout)
    gpu = trainer_for(data, folds, layout=layout, per_epoch=True)
    trained_cpu, trained_gpu = history(cpu), history(gpu)
    # Bit for bit: the masked update keeps exactly what the conditional one applied.
    assert trained_gpu == trained_cpu

    conditionals, loop_tests = zip(*(host_waits(graph) for graph in epoch_graphs(gpu)))
    assert set().union(*conditionals) == set()
    tests = [ops for per_graph in loop_tests for ops in per_graph]
    assert tests and all("LogicalAnd" not in ops and "GreaterEqual" not in ops for ops in tests)
    # The CPU plan's epoch does test the tally (and its unfused step holds a tf.cond): the
    # inspection can see what it asserts is absent.
    cpu_conditionals, cpu_tests = zip(*(host_waits(graph) for graph in epoch_graphs(cpu)))
    assert any("LogicalAnd" in ops for per_graph in cpu_tests for ops in per_graph)
    if layout != "stacked":
        assert set().union(*cpu_conditionals) & CONDITIONALS


@pytest.mark.parametrize("layout", ["sequential", "stacked"])
def test_a_fold_that_goes_nan_under_the_gpu_plan_stops_where_and_as_it_does_on_cpu(dataset, folds, layout):
    # Fold 0 alone trains on a NaN sample; 3 steps per launch, so that steps follow the failing
    # one in its launch, and under the per-epoch test in the rest of the epoch.
    x = np.concatenate([dataset.x, np.full((1, *dataset.x.shape[1:]), np.nan, np.float32)])
    y = np.concatenate([dataset.y, dataset.y[:1]])
    poisoned = [Fold(train=np.append(folds[0].train, len(dataset.y)), val=folds[0].val), *folds[1:]]
    data = resident_data("test-gpu-step-nan", x, y)
    cpu = trainer_for(data, poisoned, layout=layout, steps_per_launch=3)
    gpu = trainer_for(data, poisoned, layout=layout, steps_per_launch=3, per_epoch=True)
    trained_cpu, trained_gpu = history(cpu), history(gpu)

    failure = gpu.engines[0].failure
    assert failure is not None and failure.epoch == 1 and failure == cpu.engines[0].failure
    assert gpu.engines[1].failure is None
    np.testing.assert_equal(trained_gpu, trained_cpu)  # NaN where the CPU's are NaN, the rest equal
    for model_gpu, model_cpu in zip(gpu.models, cpu.models):
        for a, b in zip(model_gpu.get_weights(), model_cpu.get_weights()):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(gpu.engines[0].optimizer.variables, cpu.engines[0].optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_labels_and_index_batches_are_int64_on_a_gpu_and_train_the_cpus_numbers(dataset, folds, monkeypatch):
    from pipeline.engine import resident

    data_cpu = resident_data("test-gpu-step", dataset.x, dataset.y)
    cpu = with_stacked_executor(
        trainer_for(data_cpu, folds, layout="stacked"), data_cpu, stop_test="per_epoch", convolutions="grouped"
    )
    trained_cpu = history(cpu)
    # No GPU here: TensorFlow's soft placement runs what is placed on /GPU:0 on the CPU, so the
    # trial is planned and its tensors made as on a GPU.
    monkeypatch.setattr(resident, "training_device", lambda: "/GPU:0")
    a100 = GpuIdentity("NVIDIA A100-SXM4-80GB (compute 8.0)", "550.54.15", "12.9.79", "9.10.2.21")
    monkeypatch.setattr(trainer_module, "gpu_identity", lambda: a100)  # nvidia-smi's answer on such a machine
    data = resident_data("test-gpu-step-on-gpu", dataset.x, dataset.y)
    assert data.device == "/GPU:0" and data.y.dtype.name == "int64" and data_cpu.y.dtype.name == "int32"
    between_trials()
    gpu = build_trainer(
        load_builder(MNIST1D_EXPERIMENT, "build"),
        CONFIG,
        TrainingRecipe(choices=ExecutionChoices()),
        data=data,
        folds=folds,
    )
    assert gpu.plan.device == "/GPU:0" and gpu.plan.layout == "stacked" and gpu.plan.stop_test == "per_epoch"
    assert gpu.plan.stacked_convolutions == "grouped" and gpu.plan.gpu == a100
    # TensorFlow's default: TF32 on, recorded, and the forward check at TF32's tolerance.
    assert gpu.plan.tf32 and not cpu.plan.tf32 and cpu.plan.gpu is None
    assert all(tensor.dtype.name == "int64" for tensor in gpu.engines[0].epoch_batch_tensors(0))
    indices, _ = gpu._executor.epoch_batches(0, (0, 1))
    assert indices.dtype == np.int64
    assert history(gpu) == trained_cpu

    # Between epochs the stacked weights and optimizer state are copied device to device: the
    # copies are compiled graphs of variable reads, stacks, slices and assignments only.
    for copy in gpu._executor._copies((0, 1)):
        ops = {node.op for node in copy.get_concrete_function().graph.as_graph_def().node}
        assert "AssignVariableOp" in ops and ops <= {
            "ReadVariableOp",
            "AssignVariableOp",
            "Pack",
            "Unpack",
            "Const",
            "NoOp",
            "Identity",
            "Placeholder",
        }


CONVOLUTIONS = [
    [keras.layers.Conv1D(6, 3, strides=2, padding="same", activation="relu"), keras.layers.GlobalMaxPooling1D()],
    [keras.layers.Conv1D(5, 3, dilation_rate=2, padding="valid", use_bias=False), keras.layers.Flatten()],
    [
        keras.layers.Conv2D(4, (3, 2), strides=(2, 1), padding="same", activation="tanh"),
        keras.layers.Flatten(),
        keras.layers.Dense(3, activation="softmax"),
    ],
    [
        keras.layers.Conv2D(3, (2, 3), dilation_rate=(1, 2), padding="same"),
        keras.layers.Conv2D(2, 2),
        keras.layers.Flatten(),
    ],
]


def fold_models(layers, shape, n_folds=3):
    models = []
    for seed in range(n_folds):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input(shape=shape)
        x = inputs
        for layer in layers:
            x = layer.__class__.from_config(layer.get_config())(x)
        models.append(keras.Model(inputs, x))
    return models


@pytest.mark.parametrize("layers, shape", zip(CONVOLUTIONS, [(11, 2), (12, 3), (9, 8, 2), (7, 9, 3)]))
def test_grouped_convolutions_give_the_patch_products_outputs(layers, shape):
    import tensorflow as tf

    models = fold_models(layers, shape)
    samples = np.random.default_rng(0).normal(size=(3 * 4, *shape)).astype(np.float32)  # 4 per fold
    values = {
        id(variable): tf.constant(weights)
        for variable, weights in zip(models[0].trainable_variables, stacked_weights(models))
    }
    ones = tf.ones([3, 4])
    patches, _ = StackedForm(models[0], values, 3, convolutions="patches")(samples, ones)
    grouped, _ = StackedForm(models[0], values, 3, convolutions="grouped")(samples, ones)
    # As the GPU's compiled step runs it: under XLA (feature_group_count), and as eagerly checked.
    compiled = tf.function(
        lambda x: StackedForm(models[0], values, 3, convolutions="grouped")(x, ones)[0], jit_compile=True
    )(samples)
    np.testing.assert_allclose(grouped, patches, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(compiled, patches, rtol=1e-5, atol=1e-6)
    assert forward_matches(models, samples, convolutions="grouped")
    assert forward_matches(models, samples, convolutions="grouped", tf32=True)


def test_the_tf32_tolerance_still_refuses_a_layer_that_mixes_the_folds_samples():
    def build():
        inputs = keras.Input(shape=(4,))
        centred = keras.layers.Lambda(lambda x: x - keras.ops.mean(x, axis=0, keepdims=True))(inputs)
        return keras.Model(inputs, keras.layers.Dense(2)(centred))

    models = []
    for seed in range(3):
        keras.utils.set_random_seed(seed)
        models.append(build())
    samples = np.random.default_rng(0).normal(size=(3 * 4, 4)).astype(np.float32)
    assert forward_tolerance(True) > forward_tolerance(False)
    assert forward_mismatch(models, samples, tf32=True) == (
        "the stacked forward pass does not reproduce the model's outputs"
    )


def test_stacked_folds_train_with_grouped_convolutions_as_with_patch_products(dataset, folds):
    data = resident_data("test-gpu-step", dataset.x, dataset.y)
    patches = trainer_for(data, folds, layout="stacked")
    between_trials()
    grouped = build_trainer(
        load_builder(MNIST1D_EXPERIMENT, "build"),
        CONFIG,
        TrainingRecipe(choices=ExecutionChoices(fused="on", layout="stacked")),
        data=data,
        folds=folds,
        replay=replace(patches.plan, stacked_convolutions="grouped"),
    )
    # Another form is another rounding: not replayed as the recorded plan's own execution.
    assert grouped.plan.stacked_convolutions == "patches"
    grouped = with_stacked_executor(trainer_for(data, folds, layout="stacked"), data, convolutions="grouped")
    trained_patches, trained_grouped = history(patches), history(grouped)
    for key, values in trained_patches.items():
        np.testing.assert_allclose(trained_grouped[key], values, rtol=1e-4, err_msg=key)
