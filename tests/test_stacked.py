"""Fold-fused training: the same per-fold results as separate training one step per launch,
in either layout and with steps unrolled into one launch; folds independent."""

from __future__ import annotations

import math
from types import SimpleNamespace

import keras
import numpy as np
import pytest
from helpers import MNIST1D_EXPERIMENT, mnist1d_fixtures
from run_machinery import between_trials

from pipeline.base import compile_cache
from pipeline.contract.plan import ExecutionChoices
from pipeline.engine.recipe import TrainingRecipe
from pipeline.engine.resident import resident_data
from pipeline.engine.stacked import (
    forward_matches,
    forward_mismatch,
    held_once_blocker,
    held_once_variables,
    model_blocker,
    steps_blocker,
)
from pipeline.engine.trainer import build_trainer
from pipeline.inputs.folds import Fold
from pipeline.inputs.hypermodel import load_builder

pytestmark = pytest.mark.training  # every test trains fold models, fused and not

MODEL = {"conv_layers": 1, "filters": 16, "kernel_size": 3}
HISTORY_KEYS = ("train_loss", "val_loss", "val_accuracy")


# Two folds: side by side, each fold is one more model in the program XLA compiles, and the
# compile is most of each case's time.
dataset, folds = mnist1d_fixtures(410)


def train(
    x,
    y,
    folds,
    *,
    fused,
    epochs=2,
    fingerprint=None,
    dropout=0.0,
    jit_compile="auto",
    steps_per_launch=1,
    layout="side_by_side",
    build=None,
    inline_step=False,
    pad_last_batch=False,
    **params,
):
    """Per-fold history {fold: {key: [value per epoch]}} and the trainer."""
    between_trials()
    settings = {"batch_size": 8, "learning_rate": 1e-3, "optimizer": "adam", **params}
    fingerprint = fingerprint or f"test-fused-{len(y)}"
    choices = ExecutionChoices(
        jit_compile=jit_compile,
        fused=fused,
        steps_per_launch=steps_per_launch,
        layout=layout,
        inline_step=inline_step,
        pad_last_batch=pad_last_batch,
    )
    trainer = build_trainer(
        build or load_builder(MNIST1D_EXPERIMENT, "build"),
        {**MODEL, "dropout": dropout, **settings},
        TrainingRecipe(choices=choices),
        data=resident_data(fingerprint, x, y),
        folds=folds,
    )
    history: dict[int, dict[str, list[float]]] = {k: {key: [] for key in HISTORY_KEYS} for k in range(len(folds))}
    for _ in range(epochs):
        result = trainer.run_epoch().report()
        for k in range(len(folds)):
            for key in HISTORY_KEYS:
                history[k][key].append(result[f"split{k}_{key}"])
    return history, trainer


def with_extra_sample(dataset, folds, sample: np.ndarray, name: str):
    """The dataset plus one sample that only fold 0 trains on (the other folds never see it)."""
    x = np.concatenate([dataset.x, sample[None]]).astype(np.float32)
    y = np.concatenate([dataset.y, dataset.y[:1]])
    extra = len(dataset.y)
    changed = [Fold(train=np.append(folds[0].train, extra), val=folds[0].val), *folds[1:]]
    return x, y, changed, f"test-fused-{name}"


@pytest.fixture(scope="module")
def trained_once():
    """A training several cases compare against, trained once for the module (each first epoch
    compiles its programs: 2 to 7 s, where the next epochs take hundredths)."""
    trained = {}

    def once(description, training):
        if description not in trained:
            trained[description] = training()
        return trained[description]

    return once


@pytest.fixture(scope="module")
def unfused_reference(dataset, folds, trained_once):
    """Unfused training, one step per launch: what every fused layout and unrolling must match."""

    def reference(dropout, jit):
        return trained_once(
            f"unfused, dropout {dropout}, jit {jit}",
            lambda: train(dataset.x, dataset.y, folds, fused="off", dropout=dropout, jit_compile=jit),
        )

    return reference


@pytest.mark.parametrize(
    "dropout, jit, steps_per_launch, layout",
    [
        (0.0, "auto", 1, "side_by_side"),
        (0.0, "auto", 4, "side_by_side"),
        (0.2, "off", 1, "side_by_side"),
        (0.0, "auto", 1, "stacked"),
        (0.0, "auto", 4, "stacked"),
        (0.2, "auto", 1, "stacked"),
    ],
)
def test_fused_and_unfused_per_fold_histories_match(
    dataset, folds, unfused_reference, dropout, jit, steps_per_launch, layout
):
    # Folds of 164 training samples: 20 full batches of 8 each and a remainder of 4 (with 4 steps
    # per launch: 5 launches, then the remainder alone).
    fused, fused_trainer = train(
        dataset.x,
        dataset.y,
        folds,
        fused="on",
        dropout=dropout,
        jit_compile=jit,
        steps_per_launch=steps_per_launch,
        layout=layout,
    )
    unfused, unfused_trainer = unfused_reference(dropout, jit)
    assert fused_trainer.plan.layout == layout and unfused_trainer.plan.layout == "sequential"
    assert fused_trainer.plan.steps_per_launch == steps_per_launch and unfused_trainer.plan.steps_per_launch == 1
    # Unrolled steps are compiled as one program, whose float rounding may differ in the last bits.
    rtol = 1e-5 if steps_per_launch == 1 else 1e-4
    for k in range(len(folds)):
        for key in HISTORY_KEYS:
            np.testing.assert_allclose(fused[k][key], unfused[k][key], rtol=rtol, err_msg=f"fold {k} {key}")
    # The folds differ from each other, so matching fold by fold is not matching by accident.
    assert len({round(fused[k]["val_loss"][-1], 6) for k in range(len(folds))}) == len(folds)
    for fused_model, unfused_model in zip(fused_trainer.models, unfused_trainer.models):
        for a, b in zip(fused_model.get_weights(), unfused_model.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def _step_calls_of_marked_launches(monkeypatch) -> list[int]:
    """Filled as the epoch is traced: for each launch whose call is marked for XLA, the calls it
    makes to a step kept a call of its own (``_noinline``), which XLA lowers once."""
    calls: list[int] = []
    mark = compile_cache.compile_call

    def spy(call):
        library = {function.signature.name: function for function in call.graph.as_graph_def().library.function}
        launch = library[call.get_attr("f").name]
        kept = {name for name, function in library.items() if function.attr["_noinline"].b}
        calls.append(sum(node.attr["f"].func.name in kept for node in launch.node_def))
        mark(call)

    monkeypatch.setattr(compile_cache, "compile_call", spy)
    return calls


@pytest.mark.parametrize("layout", ["sequential", "stacked"])
def test_a_launch_lowers_its_step_once_and_trains_as_when_xla_got_every_step_inlined(
    dataset, folds, monkeypatch, layout
):
    """XLA lowers a launch's step once (TensorFlow inlines every function a function compiled
    whole calls, so the step's copies were lowered one by one): the same numbers, bit for bit."""
    import tensorflow as tf

    from pipeline.engine import fold_engine, stacked

    settings = {"fused": "off" if layout == "sequential" else "on", "layout": layout, "epochs": 2}
    calls = _step_calls_of_marked_launches(monkeypatch)
    lowered_once, trainer = train(dataset.x, dataset.y, folds, jit_compile="on", steps_per_launch=3, **settings)
    assert trainer.plan.layout == layout and trainer.plan.jit_compile
    # Each fold's launch of 3 steps (the stacked folds' one), then launches of one step: a batch
    # that does not fill a launch, and a fold's remainder (the stacked folds pad theirs).
    assert sorted(set(calls)) == [1, 3] and calls.count(3) == (1 if layout == "stacked" else len(folds))

    def compiled_whole(steps, *, jit_compile):
        return tf.function(steps, jit_compile=jit_compile, autograph=False)

    for module in (fold_engine, stacked):
        monkeypatch.setattr(module, "compiled_launch", compiled_whole)
    inlined, _ = train(dataset.x, dataset.y, folds, jit_compile="on", steps_per_launch=3, **settings)
    assert lowered_once == inlined


def test_an_uncompiled_step_is_one_function_the_epoch_calls_unless_inlined_as_recorded_trials_had_it(dataset, folds):
    """Without XLA the step is a function of its own (``_noinline``) that every call of the epoch
    (its launch loops, its last batch) calls, so TensorFlow's graph optimizer works through it
    once; ``inline_step`` inlines it at each call, as trials recorded before ran it."""

    def called_functions(trainer) -> int:
        """How many functions the first fold's epoch graph keeps as calls (``_noinline``)."""
        engine = trainer.engines[0]
        graph = engine._train_epoch.get_concrete_function(*engine.epoch_batch_tensors(1)).graph
        return sum(function.attr["_noinline"].b for function in graph.as_graph_def().library.function)

    called, trainer = train(dataset.x, dataset.y, folds, fused="off", jit_compile="off")
    assert not trainer.plan.jit_compile and not trainer.plan.step_inlined
    assert called_functions(trainer) == 1
    inlined, trainer = train(dataset.x, dataset.y, folds, fused="off", jit_compile="off", inline_step=True)
    assert trainer.plan.step_inlined and called_functions(trainer) == 0
    for k in called:
        for key in HISTORY_KEYS:
            np.testing.assert_allclose(called[k][key], inlined[k][key], rtol=1e-4)


def compiled_build(hp):
    """The MNIST-1D CNN compiled by its hypermodel, as KerasTuner's guide does: its own optimizer
    with a searched learning rate and its own clipping, and a loss on one-hot targets."""
    model = load_builder(MNIST1D_EXPERIMENT, "build")(hp)
    learning_rate = hp.Float("lr", 1e-4, 1e-2, sampling="log", default=3e-3)
    model.compile(
        optimizer=keras.optimizers.RMSprop(learning_rate=learning_rate, clipnorm=0.5),
        loss="categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


@pytest.mark.parametrize("layout", ["side_by_side", "stacked"])
def test_a_hypermodel_compiled_optimizer_trains_the_same_fused_and_unfused(
    dataset, folds, unfused_reference, trained_once, layout
):
    fused, trainer = train(dataset.x, dataset.y, folds, fused="on", layout=layout, build=compiled_build)
    unfused, _ = trained_once(
        "compiled by the hypermodel, unfused",
        lambda: train(dataset.x, dataset.y, folds, fused="off", build=compiled_build),
    )
    assert trainer.plan.layout == layout and trainer.optimizer.source == "hypermodel"
    assert trainer.optimizer.cls is keras.optimizers.RMSprop and trainer.optimizer.clipping == ("norm", 0.5)
    assert trainer.loss.one_hot and trainer.engines[0].optimizer is not trainer.engines[1].optimizer
    for k in range(len(folds)):
        for key in HISTORY_KEYS:
            np.testing.assert_allclose(fused[k][key], unfused[k][key], rtol=1e-5, err_msg=f"fold {k} {key}")
    # foldsweep's own Adam would train otherwise: the compiled optimizer is the one in use.
    default, _ = unfused_reference(0.0, "auto")
    assert not np.allclose(default[0]["train_loss"], unfused[0]["train_loss"], rtol=1e-3)


@pytest.mark.parametrize(
    "steps_per_launch, layout, jit_compile",
    [
        (1, "side_by_side", "auto"),
        (3, "side_by_side", "auto"),
        (1, "side_by_side", "off"),  # each fold's epoch a function of its own (shared_epochs)
        (1, "stacked", "auto"),
        (3, "stacked", "auto"),
    ],
)
def test_a_nan_fold_leaves_the_other_folds_histories_unchanged(
    dataset, folds, trained_once, steps_per_launch, layout, jit_compile
):
    poisoned = np.full(dataset.x.shape[1:], np.nan, dtype=np.float32)
    x, y, changed, name = with_extra_sample(dataset, folds, poisoned, "nan")

    def training(x, y, fingerprint, steps):
        return train(
            x,
            y,
            changed,
            fused="on",
            fingerprint=fingerprint,
            epochs=3,
            steps_per_launch=steps,
            layout=layout,
            jit_compile=jit_compile,
        )

    def poisoned(steps):
        key = f"nan in fold 0, {layout}, {steps} per launch, jit {jit_compile}"
        return trained_once(key, lambda: training(x, y, name, steps))

    with_nan, trainer = poisoned(steps_per_launch)
    x_clean, y_clean, _, clean_name = with_extra_sample(dataset, folds, dataset.x[0], "clean")
    clean, _ = training(x_clean, y_clean, clean_name, steps_per_launch)
    assert trainer.plan.layout == layout
    shared_epochs = getattr(trainer._executor, "epochs", None) is not None
    plan = trainer.plan
    assert shared_epochs == (layout == "side_by_side" and (not plan.jit_compile or plan.last_batch_padded))

    failure = trainer.engines[0].failure
    assert failure is not None and failure.epoch == 1
    # The step that failed is the batch holding the poisoned sample in fold 0's first-epoch order.
    order = trainer.engines[0].epoch_order(0)
    assert failure.step == int(np.flatnonzero(order == len(dataset.y))[0]) // 8
    assert all(math.isnan(value) for value in with_nan[0]["val_loss"])
    for k in range(1, len(folds)):
        assert trainer.engines[k].failure is None
        for key in HISTORY_KEYS:
            np.testing.assert_allclose(with_nan[k][key], clean[k][key], rtol=1e-6, err_msg=f"fold {k} {key}")
    if steps_per_launch > 1:
        # The failed fold keeps the weights of its last good step: the steps after the failing
        # one in the same launch applied nothing (and no later epoch trains it).
        assert failure.step % steps_per_launch < steps_per_launch - 1  # steps did follow it in its launch
        _, one_per_launch = poisoned(1)
        assert one_per_launch.engines[0].failure == failure
        for a, b in zip(trainer.models[0].get_weights(), one_per_launch.models[0].get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# Side by side each fold clips in its own Keras optimizer, by any argument alike: global_norm, the
# one whose norm spans variables, stands for them there. Stacked, foldsweep clips each fold's slices.
@pytest.mark.parametrize(
    "clipping, layout",
    [
        ("global_norm", "side_by_side"),
        ("global_norm", "stacked"),
        ("norm", "stacked"),
        ("value", "stacked"),
    ],
)
def test_clipping_is_applied_per_fold(dataset, folds, trained_once, clipping, layout):
    # Fold 0 alone trains on a sample scaled 1e4: its gradients are huge. Were the norm taken
    # across folds, the other folds' updates would be clipped by fold 0's gradients.
    x, y, changed, name = with_extra_sample(dataset, folds, dataset.x[0] * 1e4, f"huge-{clipping}")
    x_calm, y_calm, _, calm_name = with_extra_sample(dataset, folds, dataset.x[0], f"calm-{clipping}")
    # Elementwise clipping needs a lower threshold to change these gradients at all.
    clip = {"clipping": clipping, "clip_threshold": 0.01 if clipping == "value" else 0.5, "learning_rate": 3e-3}
    huge, trainer = train(x, y, changed, fused="on", fingerprint=name, layout=layout, **clip)
    calm, _ = train(x_calm, y_calm, changed, fused="on", fingerprint=calm_name, layout=layout, **clip)
    unclipped, _ = trained_once(
        f"calm, unclipped, {layout}",
        lambda: train(x_calm, y_calm, changed, fused="on", fingerprint=calm_name, layout=layout, learning_rate=3e-3),
    )

    assert trainer.plan.layout == layout
    assert not np.allclose(huge[0]["train_loss"], calm[0]["train_loss"], rtol=1e-3)  # fold 0 did see it
    for k in range(1, len(folds)):
        for key in HISTORY_KEYS:
            np.testing.assert_allclose(huge[k][key], calm[k][key], rtol=1e-6, err_msg=f"fold {k} {key}")
        # ... and the clipping is on in those folds: without it they train differently.
        assert not np.allclose(calm[k]["train_loss"], unclipped[k]["train_loss"], rtol=1e-4)


def test_fold_models_sharing_a_frozen_layer_are_not_fused(dataset, folds):
    shared = keras.layers.Dense(10, activation="relu", trainable=False)  # a frozen base, kept between builds

    def build(hp):
        inputs = keras.Input(shape=dataset.input_shape)
        features = shared(keras.layers.Flatten()(inputs))
        return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(features))

    trainer = build_trainer(
        build,
        {"batch_size": 8},
        TrainingRecipe(),
        data=resident_data("test-fused-400", dataset.x, dataset.y),
        folds=folds,
    )
    assert trainer.plan.layout == "sequential"
    assert "share 2 variables" in trainer.plan.reason


def test_stacked_folds_need_as_many_steps_per_epoch():
    assert steps_blocker([266, 267, 267], 8) is None  # 33 full batches and a remainder each
    assert steps_blocker([264, 265], 8) == "folds take 33 to 34 steps per epoch at batch 8"


def _three_models(build):
    models = []
    for seed in range(3):
        keras.utils.set_random_seed(seed)
        models.append(build())
    return models


@pytest.mark.parametrize(
    "layers, shape",
    [
        (
            [
                keras.layers.Conv1D(6, 3, strides=2, padding="same", activation="relu"),
                keras.layers.GlobalMaxPooling1D(),
            ],
            (11, 2),
        ),
        (
            [keras.layers.Conv1D(5, 3, dilation_rate=2, padding="valid", use_bias=False), keras.layers.Flatten()],
            (12, 3),
        ),
        (
            [
                keras.layers.Conv2D(4, (3, 2), strides=(2, 1), padding="same", activation="tanh"),
                keras.layers.MaxPooling2D(2),
                keras.layers.Flatten(),
                keras.layers.Dense(3, activation="softmax"),
            ],
            (9, 8, 2),
        ),
        ([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)], (5, 3)),  # Dense on each of 5 steps
        (
            [
                keras.layers.DepthwiseConv2D(3, depth_multiplier=2, strides=2, padding="same", activation="relu"),
                keras.layers.Flatten(),
            ],
            (9, 8, 3),
        ),
        ([keras.layers.DepthwiseConv1D(3, dilation_rate=2, use_bias=False), keras.layers.Flatten()], (12, 3)),
        (
            [keras.layers.SeparableConv2D(4, 3, depth_multiplier=2, padding="same"), keras.layers.Flatten()],
            (8, 7, 3),
        ),
        ([keras.layers.SeparableConv1D(5, 3, strides=2, activation="relu"), keras.layers.Flatten()], (11, 2)),
        ([keras.layers.Conv2DTranspose(4, 3, strides=2, padding="same"), keras.layers.Flatten()], (5, 4, 3)),
        (
            [
                keras.layers.Conv2DTranspose(3, (3, 2), strides=(2, 1), output_padding=(1, 0), activation="tanh"),
                keras.layers.Flatten(),
            ],
            (5, 4, 2),
        ),
        ([keras.layers.Conv1DTranspose(4, 3, strides=2, use_bias=False), keras.layers.Flatten()], (6, 3)),
        # No trainable weight, yet each fold's own moving statistics.
        ([keras.layers.BatchNormalization(center=False, scale=False), keras.layers.Dense(2)], (5, 3)),
    ],
)
@pytest.mark.parametrize("convolutions", ["patches", "grouped"])
def test_the_stacked_forward_pass_reproduces_each_fold_models_outputs(layers, shape, convolutions):
    def build():
        inputs = keras.Input(shape=shape)
        x = inputs
        for layer in layers:
            x = layer.__class__.from_config(layer.get_config())(x)
        return keras.Model(inputs, x)

    models = _three_models(build)
    assert model_blocker(models[0]) is None
    samples = np.random.default_rng(0).normal(size=(3 * 4, *shape)).astype(np.float32)  # 4 per fold
    assert forward_matches(models, samples, convolutions=convolutions)


def _backbone(*, frozen):
    """A small Functional backbone (what keras.applications builds) with BatchNormalization."""
    inputs = keras.Input(shape=(8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="stem")(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    x = keras.layers.DepthwiseConv2D(3, padding="same")(x)
    backbone = keras.Model(inputs, keras.layers.BatchNormalization()(x), name="backbone")
    backbone.trainable = not frozen
    return backbone


def _transfer_models(*, frozen, same_backbone):
    """keras.io's transfer learning shape: a Sequential of layers applied to the inputs, a nested
    backbone called with training=False, a pooled Dense head; three fold models."""
    keras.utils.set_random_seed(7)
    source = _backbone(frozen=frozen).get_weights()  # what a weights file would hold

    def build():
        inputs = keras.Input(shape=(8, 8, 3))
        x = keras.Sequential([keras.layers.Dropout(0.1), keras.layers.Rescaling(2.0)], name="augment")(inputs)
        backbone = _backbone(frozen=frozen)  # each fold's own draw
        if same_backbone:
            backbone.set_weights(source)
        x = backbone(x, training=False)
        return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(x)))

    return _three_models(build)


@pytest.mark.parametrize("frozen", [True, False])
def test_nested_models_are_walked_into_and_frozen_weights_held_once(frozen):
    models = _transfer_models(frozen=frozen, same_backbone=True)
    assert model_blocker(models[0], random_draws="counter") is None
    assert held_once_blocker(models) is None
    # Frozen: the backbone's kernels and BatchNormalization statistics are held once, in
    # inference mode (as Keras' BatchNormalization runs when its layer is not trainable).
    assert len(held_once_variables(models[0])) == (1 + 4 + 2 + 4 if frozen else 0)
    samples = np.random.default_rng(0).normal(size=(3 * 4, 8, 8, 3)).astype(np.float32)
    assert forward_mismatch(models, samples) is None


def test_frozen_weights_that_differ_between_the_folds_are_not_held_once():
    models = _transfer_models(frozen=True, same_backbone=False)
    assert model_blocker(models[0], random_draws="counter") is None
    assert held_once_blocker(models) == (
        "frozen weights stem/kernel differ between the folds (each fold's model draws its own; "
        "weights loaded from a file are held once)"
    )


class _CountingLayer(keras.layers.Layer):
    """A layer that writes a non-trainable variable of its own in training."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, x, training=False):
        if training:
            self.calls.assign_add(1.0)
        return x


def test_non_trainable_weights_that_move_in_training_are_not_held_once():
    def build():
        inputs = keras.Input(shape=(4,))
        return keras.Model(inputs, keras.layers.Dense(2)(_CountingLayer(name="counting")(inputs)))

    models = _three_models(build)
    assert model_blocker(models[0]) is None and held_once_blocker(models) is None
    samples = np.random.default_rng(0).normal(size=(3 * 4, 4)).astype(np.float32)
    assert forward_mismatch(models, samples) == (
        "counting/variable is not trainable and not state a stacked form updates, yet moves in training: it cannot "
        "be held once for every fold"
    )
    assert [float(model.layers[1].calls) for model in models] == [0.0, 0.0, 0.0]  # as they were


def test_a_layer_that_mixes_samples_fails_the_forward_check():
    def build():
        inputs = keras.Input(shape=(4,))
        centred = keras.layers.Lambda(lambda x: x - keras.ops.mean(x, axis=0, keepdims=True))(inputs)
        return keras.Model(inputs, keras.layers.Dense(2)(centred))

    models = _three_models(build)
    assert model_blocker(models[0]) is None  # no weights in the Lambda: only the forward check can tell
    samples = np.random.default_rng(0).normal(size=(3 * 4, 4)).astype(np.float32)
    assert not forward_matches(models, samples)


def test_fold_models_without_a_stacked_form_train_side_by_side(dataset, folds):
    def build(hp):
        inputs = keras.Input(shape=dataset.input_shape)
        x = keras.layers.Flatten()(keras.layers.PReLU()(keras.layers.Conv1D(4, 3)(inputs)))
        return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(x))

    trainer = build_trainer(
        build,
        {"batch_size": 8},
        TrainingRecipe(choices=ExecutionChoices(layout="stacked")),
        data=resident_data("test-fused-400", dataset.x, dataset.y),
        folds=folds,
    )
    assert trainer.plan.layout == "side_by_side"
    assert trainer.plan.reason.endswith("side by side (not stacked: PReLU layers have no stacked form)")
    result = trainer.run_epoch()
    assert all(math.isfinite(scores.val_loss) for scores in result.folds)


def every_stacked_form(hp):
    """The MNIST-1D CNN with every layer stacked folds have a form for besides Dense and Conv1D,
    and each fold's own loss terms: BatchNormalization (its momentum and epsilon not Keras'
    defaults), LayerNormalization, a kernel and an activity regularizer, and the random layers."""
    layers = keras.layers
    inputs = keras.Input(shape=(40, 1))
    x = layers.Conv1D(8, 3, padding="same", use_bias=False, kernel_regularizer=keras.regularizers.L2(1e-3))(inputs)
    x = layers.BatchNormalization(momentum=0.9, epsilon=1e-2)(x)
    x = layers.Activation("relu", activity_regularizer=keras.regularizers.L1(1e-3))(x)
    x = layers.SpatialDropout1D(0.1)(layers.MaxPooling1D(2)(x))
    x = layers.Dense(16, activation="relu")(layers.Dropout(0.3)(layers.Flatten()(x)))
    x = layers.GaussianDropout(0.1)(layers.GaussianNoise(0.1)(layers.LayerNormalization()(x)))
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(x))


def trained_stacked_and_alone(dataset, folds, build, jit_compile="auto"):
    """The fold models of ``build`` trained stacked and each alone (SGD, whose updates carry float
    rounding as it is: Adam's normalised steps magnify it), their histories checked equal; both
    trainers."""
    settings = {"build": build, "optimizer": "sgd", "learning_rate": 0.01, "jit_compile": jit_compile}
    stacked, stacked_trainer = train(dataset.x, dataset.y, folds, fused="on", layout="stacked", **settings)
    alone, alone_trainer = train(dataset.x, dataset.y, folds, fused="off", **settings)
    assert stacked_trainer.plan.layout == "stacked", stacked_trainer.plan.reason
    for k in range(len(folds)):
        for key in HISTORY_KEYS:
            np.testing.assert_allclose(stacked[k][key], alone[k][key], rtol=1e-5, err_msg=f"fold {k} {key}")
    assert len({round(stacked[k]["val_loss"][-1], 6) for k in range(len(folds))}) == len(folds)
    return stacked_trainer, alone_trainer


def test_stacked_folds_train_batch_norm_regularizers_and_random_layers_as_each_fold_alone(dataset, folds):
    stacked_trainer, alone_trainer = trained_stacked_and_alone(dataset, folds, every_stacked_form)
    assert stacked_trainer.plan.random_draws == "counter"
    assert alone_trainer.plan.random_draws == "counter" and alone_trainer.plan.jit_compile
    # Every variable, moving statistics and generator states included, as the fold trained alone.
    for stacked_model, alone_model in zip(stacked_trainer.models, alone_trainer.models):
        assert len(stacked_model.non_trainable_variables) == 2 + 4  # moving mean and variance, 4 generators
        for a, b in zip(stacked_model.variables, alone_model.variables):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=a.path)
    generators = [v for v in stacked_trainer.models[0].non_trainable_variables if "seed" in v.path]
    steps = 2 * math.ceil(len(folds[0].train) / 8)
    assert [int(np.asarray(v)[1]) for v in generators] == [steps] * 4  # one draw per layer and step


def depthwise_separable_nested_and_frozen(hp):
    """The MNIST-1D CNN in the shape of MobileNet's blocks: depthwise, separable and transposed
    convolutions inside a nested block model, and a frozen layer whose weights every fold shares."""
    layers = keras.layers
    block_inputs = keras.Input(shape=(40, 4))
    x = layers.DepthwiseConv1D(3, depth_multiplier=2, padding="same", activation="relu")(block_inputs)
    x = layers.SeparableConv1D(8, 3, strides=2, padding="same")(layers.BatchNormalization()(x))
    block = keras.Model(block_inputs, layers.Conv1DTranspose(4, 3, strides=2, padding="same")(x), name="block")
    inputs = keras.Input(shape=(40, 1))
    x = block(layers.Conv1D(4, 3, padding="same")(inputs))
    frozen = layers.Dense(6, kernel_initializer=keras.initializers.Orthogonal(seed=3), name="frozen")
    x = frozen(layers.Flatten()(x))
    frozen.trainable = False
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(x))


def test_depthwise_separable_and_transposed_convolutions_in_a_nested_model_train_stacked(dataset, folds):
    stacked_trainer, alone_trainer = trained_stacked_and_alone(dataset, folds, depthwise_separable_nested_and_frozen)
    for stacked_model, alone_model in zip(stacked_trainer.models, alone_trainer.models):
        for a, b in zip(stacked_model.variables, alone_model.variables):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=a.path)
    # The frozen kernel, held once, never moved: every fold still has the one it was built with.
    built = np.asarray(depthwise_separable_nested_and_frozen(None).get_layer("frozen").kernel)
    for model in stacked_trainer.models:
        np.testing.assert_array_equal(model.get_layer("frozen").kernel, built)


def augmented_image_cnn(hp):
    """keras.io's image classifier: a Sequential of augmentation layers applied to the inputs (here
    MNIST-1D's signals as 8 x 5 images), then Conv2D and BatchNormalization."""
    layers = keras.layers
    augmentation = keras.Sequential(
        [
            layers.RandomFlip("horizontal"),
            layers.RandomContrast(0.3, value_range=(-5, 5)),
            layers.RandomBrightness(0.1, value_range=(-5, 5)),
            layers.RandomRotation(0.1),
        ],
        name="augmentation",
    )
    inputs = keras.Input(shape=(40, 1))
    x = augmentation(layers.Reshape((8, 5, 1))(inputs))
    x = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(4, 3, padding="same", use_bias=False)(x)))
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(layers.Flatten()(x)))


def test_stacked_folds_draw_each_folds_own_augmentation_as_it_draws_alone(dataset, folds):
    # With XLA, as on a GPU (on CPU an augmented model runs without it: ``pipeline.contract.plan``).
    stacked_trainer, alone_trainer = trained_stacked_and_alone(dataset, folds, augmented_image_cnn, jit_compile="on")
    assert stacked_trainer.plan.random_draws == "counter"
    assert alone_trainer.plan.random_draws == "counter" and alone_trainer.plan.jit_compile
    generators = [v for v in stacked_trainer.models[0].non_trainable_variables if "seed" in v.path]
    steps = 2 * math.ceil(len(folds[0].train) / 8)
    assert [int(np.asarray(v)[1]) for v in generators] == [steps] * 4  # one draw per layer and step


def test_a_crop_drawn_once_per_batch_is_not_stacked():
    def build():
        inputs = keras.Input(shape=(6, 6, 1))
        x = keras.layers.RandomCrop(4, 4, name="crop")(inputs)
        return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(x)))

    assert model_blocker(_three_models(build)[0], random_draws="counter") == (
        "layer 'crop' (RandomCrop) draws one crop for the whole batch, which has no per-fold form"
    )


def _integer_samples(n_folds, rows, width, vocabulary):
    return np.random.default_rng(0).integers(0, vocabulary, size=(n_folds * rows, width)).astype(np.float32)


def test_the_forward_check_compares_state_and_loss_terms_and_leaves_the_fold_models_as_they_were():
    def build():
        inputs = keras.Input(shape=(6,))
        x = keras.layers.Embedding(5, 3, embeddings_regularizer=keras.regularizers.L2(0.1))(inputs)
        x = keras.layers.BatchNormalization()(keras.layers.Conv1D(4, 3, activity_regularizer="l2")(x))
        x = keras.layers.LayerNormalization()(keras.layers.Dropout(0.5)(keras.layers.Flatten()(x)))
        return keras.Model(inputs, keras.layers.Dense(2)(x))

    models = _three_models(build)
    before = [[np.asarray(v) for v in model.variables] for model in models]
    assert model_blocker(models[0], random_draws="counter") is None
    assert forward_mismatch(models, _integer_samples(3, 4, 6, 5)) is None
    for model, values in zip(models, before):
        for variable, value in zip(model.variables, values):
            np.testing.assert_array_equal(variable, value, err_msg=variable.path)
    assert "from Keras' generator" in model_blocker(models[0], random_draws="keras")


class _BatchPenalty(keras.layers.Layer):
    """A weightless layer adding its own loss over the whole batch (keras.io's add_loss guide)."""

    def call(self, x):
        self.add_loss(keras.ops.mean(keras.ops.abs(x)))
        return x


def test_the_forward_check_refuses_loss_terms_it_cannot_give_each_fold():
    def build():
        inputs = keras.Input(shape=(4,))
        return keras.Model(inputs, keras.layers.Dense(2)(_BatchPenalty()(inputs)))

    models = _three_models(build)
    assert model_blocker(models[0]) is None  # weightless: only the forward check can tell
    samples = np.random.default_rng(0).normal(size=(3 * 4, 4)).astype(np.float32)
    assert forward_mismatch(models, samples) == (
        "the stacked forward pass does not reproduce the model's loss terms (model.losses)"
    )


# Layers made when the test runs (a SeedGenerator made while collecting would start TensorFlow).
@pytest.mark.parametrize(
    "layer, reason",
    [
        (
            lambda: keras.layers.BatchNormalization(renorm=True, name="odd"),
            "batch normalization 'odd' with renorm=True",
        ),
        (
            lambda: keras.layers.Dense(4, kernel_constraint="max_norm", name="odd"),
            "layer 'odd' has a weight constraint",
        ),
        (
            lambda: keras.layers.Dropout(0.2, noise_shape=(1, None), name="odd"),
            "layer 'odd' has a noise_shape that fixes the batch axis",
        ),
        (
            lambda: keras.layers.Activation("relu", activity_regularizer=lambda x: keras.ops.max(x), name="odd"),
            "layer 'odd' has an activity_regularizer (function) not known to add up over samples",
        ),
    ],
)
def test_what_has_no_stacked_form_is_named(layer, reason):
    def build():
        inputs = keras.Input(shape=(4,))
        return keras.Model(inputs, keras.layers.Dense(2)(layer()(inputs)))

    assert model_blocker(_three_models(build)[0], random_draws="counter") == reason


def test_class_weights_and_labels_per_position_train_side_by_side_with_the_reason(dataset, folds):
    """What the stacked step does not apply yet falls back to side by side, the reason recorded."""
    from pipeline.inputs.spec import TrainSpec

    def classifier(hp):
        inputs = keras.Input(shape=dataset.input_shape)
        return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(keras.layers.Flatten()(inputs)))

    weighted = build_trainer(
        classifier,
        {"batch_size": 8},
        TrainingRecipe(train=TrainSpec(class_weight="balanced"), choices=ExecutionChoices(layout="stacked")),
        data=resident_data("test-fused-400", dataset.x, dataset.y),
        folds=folds,
    )
    assert weighted.plan.layout == "side_by_side"
    assert weighted.plan.reason.endswith(
        "(not stacked: train.class_weight (each fold's own weights) is not yet applied in the stacked step)"
    )

    def labeller(hp):  # a label per position of the signal
        inputs = keras.Input(shape=dataset.input_shape)
        x = keras.layers.Conv1D(4, 3, padding="same", activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Conv1D(2, 1, activation="softmax")(x))

    positions = (dataset.x[:, :, 0] > 0).astype(np.int32)
    per_position = build_trainer(
        labeller,
        {"batch_size": 8},
        TrainingRecipe(choices=ExecutionChoices(layout="stacked")),
        data=resident_data("test-fused-positions", dataset.x, positions),
        folds=folds,
    )
    assert per_position.plan.layout == "side_by_side"
    assert per_position.plan.reason.endswith(
        "(not stacked: targets with more than one value per sample (per position, or a vector) are not yet stacked)"
    )
    assert all(math.isfinite(scores.val_loss) for scores in per_position.run_epoch().folds)


def test_compiled_metrics_are_scored_in_validation_and_never_touched_by_the_training_step(dataset, folds):
    def build(hp):
        inputs = keras.Input(shape=dataset.input_shape)
        model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(keras.layers.Flatten()(inputs)))
        model.compile(
            optimizer="adam",
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=3, name="top3")],
        )
        return model

    trainer = build_trainer(
        build,
        {"batch_size": 8},
        TrainingRecipe(choices=ExecutionChoices(fused="off")),
        data=resident_data("test-fused-400", dataset.x, dataset.y),
        folds=folds,
    )
    result = trainer.run_epoch()
    assert all(0.0 <= scores.metrics["top3"] <= 1.0 for scores in result.folds)
    engine = trainer.engines[0]
    launch = engine._train_epoch.get_concrete_function(*engine.epoch_batch_tensors(0))
    trained = {id(variable) for variable in launch.variables}
    metric_variables = [variable for metric in engine.metrics._compiled.metrics for variable in metric.variables]
    assert metric_variables and not any(id(variable.value) in trained for variable in metric_variables)
    assert any(id(variable.value) in trained for variable in engine.model.trainable_variables)


def test_a_padded_last_batch_trains_each_fold_as_its_last_batch_as_it_is(dataset, folds):
    """Each fold's short last batch padded to the batch size and masked trains the same
    samples with the same numbers but for float rounding (dropout's among them: foldsweep's own
    numbers are drawn per element from the front of the batch), one XLA program per batch shape."""
    # 205 and 204 samples: last batches of 5 and 4 at batch 8, one program each unpadded.
    uneven = [folds[0], Fold(train=folds[1].train[:-1], val=folds[1].val)]
    (kept, as_is), (padded_history, padded) = (
        train(
            dataset.x,
            dataset.y,
            uneven,
            fused="on",
            steps_per_launch=4,
            dropout=0.3,
            jit_compile="on",
            pad_last_batch=pad,
        )
        for pad in (False, True)
    )
    assert padded.plan.last_batch_padded and not as_is.plan.last_batch_padded
    for k in range(len(uneven)):
        for key in HISTORY_KEYS:
            assert padded_history[k][key] == pytest.approx(kept[k][key], rel=2e-6, abs=0), (k, key)


def test_a_stacked_epoch_is_timed_with_its_copies_in_and_out_of_the_stacked_variables(dataset, folds, monkeypatch):
    """The copies of the folds' weights into the stacked variables and back are the epoch's
    training, and their first trace its compiling: the epoch's time holds them."""
    from pipeline.engine import stacked

    _, trainer = train(dataset.x, dataset.y, folds, fused="on", layout="stacked", epochs=1)
    executor = trainer._executor
    now = [0.0]
    monkeypatch.setattr(stacked, "time", SimpleNamespace(perf_counter=lambda: now[0]))  # this module's clock only
    for name in ("_load", "_store"):
        copy = getattr(executor, name)
        monkeypatch.setattr(executor, name, lambda live, copy=copy: (copy(live), now.__setitem__(0, now[0] + 30.0)))
    before = [engine.train_timer.steady_s for engine in trainer.engines]
    executor.train_epoch(1, tuple(range(len(folds))))
    charged = [engine.train_timer.steady_s - was for engine, was in zip(trainer.engines, before)]
    assert charged == [60.0 / len(folds)] * len(folds)
