"""`--check-numerics`: TensorFlow's check-numerics error texts read and placed in the fold model the
check stopped (pipeline.rerun.numerics_finding), on real texts that fold models of these cases
produced (tests/fixtures/make_check_numerics_texts.py writes them again)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import MNIST1D_EXPERIMENT
from run_machinery import between_trials

from pipeline.records.tracking import Tag

TEXTS = Path(__file__).resolve().parent / "fixtures" / "check_numerics"


def rooted(hp: Any) -> Any:
    """A square root of a ReLU: finite forward, an infinite derivative at 0 backward."""
    import keras

    inputs = keras.Input(shape=(40, 1))
    x = keras.layers.Conv1D(8, 3, padding="same", name="conv")(inputs)
    x = keras.layers.Lambda(lambda t: keras.ops.sqrt(keras.ops.relu(t)), name="root")(x)
    x = keras.layers.Flatten(name="flat")(x)
    outputs = keras.layers.Dense(10, activation="softmax", name="head")(x)
    return keras.Model(inputs, outputs, name="rooted")


def spare(hp: Any) -> Any:
    """A first layer holding a variable the loss never uses: its gradient is None."""
    import keras

    class Spare(keras.layers.Layer):
        def build(self, input_shape):
            self.unused = self.add_weight(shape=(1,), name="unused")

        def call(self, inputs):
            return inputs

    inputs = keras.Input(shape=(40, 1))
    x = Spare(name="spare")(inputs)
    x = keras.layers.Conv1D(8, 3, padding="same", activation="relu", name="conv")(x)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(10, activation="softmax", name="head")(x)
    return keras.Model(inputs, outputs, name="spare")


def mnist1d(hp: Any) -> Any:
    from pipeline.inputs.hypermodel import load_builder

    return load_builder(MNIST1D_EXPERIMENT, "build")(hp)


def huge_head(models: list[Any]) -> None:
    """Fold 0's last Dense kernel at +-1e38: its forward product overflows."""
    import keras

    head = [layer for layer in models[0].layers if isinstance(layer, keras.layers.Dense)][-1]
    signs = np.sign(np.random.default_rng(0).normal(size=head.kernel.shape)).astype(np.float32)
    head.kernel.assign(signs * np.float32(1e38))


@dataclass(frozen=True)
class Case:
    """A trial of the tiny spec's data (mnist1d, 400 samples, 2 folds) trained with numeric checking
    until it stops: ``build`` with ``values``, SGD at ``learning_rate`` and batch 8, after ``poison``."""

    text: str  # the file the error text is kept in
    build: Callable[[Any], Any]
    values: dict[str, Any]
    learning_rate: float = 50.0
    eager: bool = False
    poison: Callable[[list[Any]], None] | None = None


CASES = {
    "gradient_norm": Case("gradient_norm.txt", mnist1d, {"conv_layers": 1}),
    "gradient_norm_fold_1": Case("gradient_norm_fold_1.txt", mnist1d, {"conv_layers": 2}),
    "none_gradient": Case("none_gradient.txt", spare, {}, learning_rate=200.0),
    "forward": Case("forward.txt", mnist1d, {"conv_layers": 2}, learning_rate=0.01, poison=huge_head),
    "backward": Case("backward.txt", rooted, {}, learning_rate=0.01),
    "eager": Case("eager.txt", mnist1d, {"conv_layers": 1}, eager=True),
}
MODEL_VALUES = {"filters": 16, "kernel_size": 3, "dropout": 0.0}


def fold_models(case: Case) -> list[Any]:
    """The case's two fold models, named as the trial that wrote its text named them (Keras'
    session cleared first, as a trial worker's is)."""
    from pipeline.inputs.hypermodel import build_model

    between_trials()
    return [build_model(case.build, {**MODEL_VALUES, **case.values}, input_shape=(40, 1)) for _ in range(2)]


def finding(name: str, *, fold: int, epoch: int = 2, step: int = 5, skip: tuple[str, ...] = ()):
    """The finding of case ``name``'s text, stopped in fold ``fold``'s model, whose gradient norm adds
    up every trainable variable's gradient but those named in ``skip`` (None gradients)."""
    from pipeline.engine.fold_engine import StoppedCall
    from pipeline.rerun import numerics_finding

    model = fold_models(CASES[name])[fold]
    normed = tuple(variable for variable in model.trainable_variables if variable.path not in skip)
    stopped = StoppedCall(model, normed, epoch=epoch, step=step, fold=fold)
    return numerics_finding((TEXTS / CASES[name].text).read_text(), stopped), model


def layer_texts(model: Any) -> set[str]:
    return {f"{layer.name} ({type(layer).__name__})" for layer in model.layers}


def test_an_overflowing_gradient_norm_names_the_variable_and_its_layer_not_a_global_norm_layer():
    from pipeline.rerun import NumericsPart

    found, model = finding("gradient_norm", fold=0, epoch=1, step=7)
    assert (found.op_type, found.node, found.part) == ("L2Loss", "global_norm/L2Loss", NumericsPart.GRADIENT_NORM)
    assert (found.variable, found.layer) == ("conv1d/kernel", "conv1d (Conv1D)")
    assert found.layer in layer_texts(model)
    assert found.describe() == (
        "fold 0, epoch 1, step 7: the gradient norm, foldsweep's own check of each step (op L2Loss, node "
        "global_norm/L2Loss): the gradient of conv1d/kernel, a variable of layer conv1d (Conv1D), is the first whose "
        "sum of squares is not finite"
    )


def test_the_gradient_norm_of_fold_1_names_fold_1s_variable():
    """The text names no fold: the graph's own scopes read conv1d_2_1 for fold 1's conv1d_2."""
    found, model = finding("gradient_norm_fold_1", fold=1, epoch=1, step=3)
    assert (found.variable, found.layer) == ("conv1d_2/kernel", "conv1d_2 (Conv1D)")
    assert found.layer in layer_texts(model) and found.fold == 1
    assert 'Tensor("gradient_tape/mnist1d_cnn_1/conv1d_2_1/' in (TEXTS / "gradient_norm_fold_1.txt").read_text()


def test_a_gradient_that_is_none_takes_no_place_in_the_norm():
    """The norm's n-th L2Loss is the n-th gradient that is not None: spare/unused has none, so
    L2Loss_1 is conv/bias' (the model's second trainable variable is conv/kernel)."""
    found, model = finding("none_gradient", fold=0, skip=("spare/unused",))
    assert found.node == "global_norm/L2Loss_1"
    assert (found.variable, found.layer) == ("conv/bias", "conv (Conv1D)")
    assert found.layer in layer_texts(model)
    # The op's input, as the text shows it, is that gradient: conv's (scoped conv_1), of shape (8,).
    assert (
        'Input tensor: Tensor("gradient_tape/spare_1/conv_1/Reshape_1:0", shape=(8,)'
        in (TEXTS / "none_gradient.txt").read_text()
    )


@pytest.mark.parametrize(
    ("name", "node", "part", "layer"),
    [
        # Fold 0's model has dense and dense_1; the graph scopes their calls dense_1 and dense_1_2.
        ("forward", "mnist1d_cnn_1/dense_1_2/MatMul", "LAYER", "dense_1 (Dense)"),
        ("backward", "gradient_tape/rooted_1/root_1/SqrtGrad", "LAYER_GRADIENT", "root (Lambda)"),
    ],
)
def test_an_op_of_the_model_is_placed_in_its_layer(name, node, part, layer):
    from pipeline.rerun import NumericsPart

    found, model = finding(name, fold=0)
    assert (found.node, found.part, found.layer) == (node, NumericsPart[part], layer)
    assert layer in layer_texts(model) and found.variable == ""
    what = "in the gradient of layer" if part == "LAYER_GRADIENT" else "in layer"
    assert found.describe() == f"fold 0, epoch 2, step 5: op {found.op_type}, node {node} {what} {layer}"


def test_an_op_in_no_layer_of_the_stopped_folds_model_names_no_layer():
    """Fold 1's model (conv1d_2, ..., dense_2, dense_3) holds nothing that fold 0's scopes name."""
    from pipeline.rerun import NumericsPart

    found, _ = finding("forward", fold=1)
    assert (found.part, found.layer, found.fold) == (NumericsPart.OUTSIDE, "", 1)
    assert found.describe().endswith("node mnist1d_cnn_1/dense_1_2/MatMul, outside the model's layers")


def test_an_eager_text_gives_the_op_and_the_place_only():
    from pipeline.rerun import NumericsPart

    found, _ = finding("eager", fold=0, epoch=1, step=7, skip=())
    assert (found.op_type, found.node, found.part, found.layer) == ("L2Loss", "", NumericsPart.OUTSIDE, "")
    assert found.describe().startswith("fold 0, epoch 1, step 7: op L2Loss (run eagerly")


def test_validation_is_placed_in_its_epoch_without_a_step():
    from pipeline.contract.results import EVAL_STEP

    found, _ = finding("forward", fold=0, epoch=3, step=EVAL_STEP)
    assert found.place() == "fold 0, validation of epoch 3"


@pytest.mark.training
@pytest.mark.filterwarnings("ignore:Gradients do not exist for variables")
def test_the_fold_engine_keeps_the_variables_its_gradient_norm_adds_up():
    """What ``finding(..., skip=("spare/unused",))`` assumes of the engine: a None gradient is left
    out of ``norm_variables``, once the step is traced."""
    import keras

    from pipeline.contract.plan import ThreadPlan, TrialPlan
    from pipeline.engine.fold_engine import FoldEngine
    from pipeline.engine.recipe import TrainingParams, TrainingRecipe
    from pipeline.engine.resident import resident_data
    from pipeline.inputs.folds import Fold
    from pipeline.inputs.losses import TrainingLoss

    model = fold_models(CASES["none_gradient"])[0]
    x = np.random.default_rng(0).normal(size=(24, 40, 1)).astype(np.float32)
    y = np.arange(24, dtype=np.int32) % 10
    engine = FoldEngine(
        model,
        keras.optimizers.SGD(),
        resident_data("numerics-test", x, y),
        Fold(train=np.arange(16), val=np.arange(16, 24)),
        plan=TrialPlan(
            jit_compile=False,
            steps_per_launch=1,
            layout="sequential",
            reason="",
            threads=ThreadPlan(0, 0),
            device="/CPU:0",
        ),
        recipe=TrainingRecipe(),
        params=TrainingParams(batch_size=8, learning_rate=0.01, optimizer="sgd"),
        loss=TrainingLoss(keras.losses.sparse_categorical_crossentropy),
        seed=0,
    )
    assert engine.norm_variables == []
    engine.train_epoch(0)
    assert [variable.path for variable in engine.norm_variables] == [
        "conv/kernel",
        "conv/bias",
        "hidden/kernel",
        "hidden/bias",
        "head/kernel",
        "head/bias",
    ]
    assert engine.stopped_call() is None


def test_a_rerun_sets_where_its_trial_went_nan_against_where_the_check_stopped():
    from pipeline.rerun import NumericsFinding, NumericsPart, recorded_nan_line

    found = NumericsFinding("L2Loss", "global_norm/L2Loss", NumericsPart.GRADIENT_NORM, fold=0, epoch=2, step=5)
    source = f"its tags {Tag.of('nan_fold')}, nan_epoch, nan_step"
    assert (
        recorded_nan_line(found, {Tag.of("nan_fold"): "0", Tag.of("nan_epoch"): "2", Tag.of("nan_step"): "5"})
        == f"the recorded trial went NaN at the same place (fold 0, epoch 2, step 5: {source})"
    )
    assert (
        recorded_nan_line(found, {Tag.of("nan_fold"): "1", Tag.of("nan_epoch"): "2", Tag.of("nan_step"): "-1"})
        == f"the recorded trial went NaN at fold 1, validation of epoch 2 ({source}), not where this run's check stopped"
    )
    assert recorded_nan_line(found, {Tag.STATUS: "ok"}) == "the recorded trial did not go NaN"
