"""The fold trainer: lockstep epochs, CV summaries, determinism, and checkpoint state."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import MNIST1D_EXPERIMENT, mnist1d_folds
from run_machinery import between_trials, cores_per_worker

from pipeline.base import compile_cache
from pipeline.contract.plan import ExecutionChoices, ThreadPlan, TrialPlan, plan_threads
from pipeline.contract.results import COMPILE_CACHE_HITS, COMPILE_CACHE_MISSES, cv_summary
from pipeline.engine.fold_engine import fold_seed
from pipeline.engine.recipe import TrainingRecipe
from pipeline.engine.resident import resident_data
from pipeline.engine.runtime import threads_in_effect
from pipeline.engine.trainer import build_trainer
from pipeline.inputs.datasets import load_dataset
from pipeline.inputs.folds import make_folds
from pipeline.inputs.hypermodel import load_builder
from pipeline.inputs.spec import CVSpec, DatasetSpec, TrainSpec

pytestmark = pytest.mark.training  # every test trains fold models

MODEL = {"conv_layers": 1, "filters": 16, "kernel_size": 3, "dropout": 0.1}
# A fold engine's plan when a test builds one itself: one fold, no XLA, one step per launch.
SEQUENTIAL_WITHOUT_XLA = TrialPlan(
    jit_compile=False, steps_per_launch=1, layout="sequential", reason="", threads=ThreadPlan(0, 0), device="/CPU:0"
)


@pytest.fixture(scope="module")
def data_and_folds():
    return mnist1d_folds(300)


def trainer(data_and_folds, seed=0, batch_size=32, jit_compile="auto"):
    data, folds = data_and_folds
    return build_trainer(
        load_builder(MNIST1D_EXPERIMENT, "build"),
        {**MODEL, "batch_size": batch_size, "learning_rate": 1e-3, "optimizer": "adam"},
        TrainingRecipe(TrainSpec(seed=seed), ExecutionChoices(jit_compile=jit_compile)),
        data=resident_data(data.fingerprint, data.x, data.y),
        folds=folds,
    )


def fold_engine(data_and_folds, model, loss, *, plan=SEQUENTIAL_WITHOUT_XLA, fold=0, template=None):
    """A fold engine of ``model`` (unbuilt) on ``fold``, Adam at batch 32, with ``loss``, its step
    the ``template``'s where that is its own."""
    import keras

    from pipeline.engine.fold_engine import FoldEngine
    from pipeline.engine.recipe import TrainingParams
    from pipeline.inputs.losses import TrainingLoss

    data, folds = data_and_folds
    model.build((None, *data.x.shape[1:]))
    return FoldEngine(
        model,
        keras.optimizers.Adam(),
        resident_data(data.fingerprint, data.x, data.y),
        folds[fold],
        plan=plan,
        recipe=TrainingRecipe(),
        params=TrainingParams(batch_size=32, learning_rate=1e-3, optimizer="adam"),
        loss=TrainingLoss(loss),
        seed=0,
        template=template,
    )


def test_models_trained_beside_other_pytest_workers_get_the_thread_pools_of_a_trial_of_their_cores():
    """conftest sizes the pools before the first test starts TensorFlow: beside other workers, a
    trial's of the worker's share of the cores (two cores, two workers: a thread per pool, as the
    sweeps' one-CPU trials plan); alone, TensorFlow's default (0)."""
    cores = cores_per_worker()
    if cores is None:
        assert threads_in_effect() == ThreadPlan(0, 0)
    else:
        assert threads_in_effect() == plan_threads(ExecutionChoices(), cpus=cores, n_folds=2)
    if cores == 1:
        assert threads_in_effect() == ThreadPlan(1, 1)


def test_a_trainer_built_after_clearing_keras_session_loads_the_programs_of_an_identical_one():
    """conftest compiles this process's programs through the run's compile cache, as a trial
    worker's: after Keras' session is cleared, as between a worker's trials, the same trainer
    again compiles nothing."""
    cache = compile_cache.active()
    assert cache is not None and cache.store.parent == Path(os.environ[compile_cache.DIRECTORY_VARIABLE])
    data = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 120}))  # programs of this test only
    folds = make_folds(CVSpec(splitter="stratified", n_splits=2, seed=0), data).folds
    reports = []
    for _ in range(2):
        between_trials()
        reports.append(trainer((data, folds), jit_compile="on").run_epoch().report())
    first, second = reports
    assert first[COMPILE_CACHE_MISSES] > 0
    assert second[COMPILE_CACHE_MISSES] == 0 and second[COMPILE_CACHE_HITS] == first[COMPILE_CACHE_MISSES]
    for key in ("split0_train_loss", "split1_train_loss", "mean_val_loss"):
        assert second[key] == first[key], key  # the loaded programs train bit-identically


def test_side_by_side_folds_train_one_program_compiled_once():
    """Each fold's model is built under the same layer names, which are in its traced step's
    graph: three folds side by side compile what one fold alone compiles, and train as before."""
    data = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 150}))  # this test's programs only
    folds = make_folds(CVSpec(splitter="stratified", n_splits=3, seed=0), data).folds
    resident = resident_data(data.fingerprint, data.x, data.y)
    config = {**MODEL, "batch_size": 16, "learning_rate": 1e-3, "optimizer": "adam"}
    recipe = TrainingRecipe(TrainSpec(seed=0), ExecutionChoices(jit_compile="on", layout="side_by_side"))
    builder = load_builder(MNIST1D_EXPERIMENT, "build")
    between_trials()
    alone = build_trainer(builder, config, recipe, data=resident, folds=folds[2:], fold_ids=[2]).run_epoch().report()
    assert alone[COMPILE_CACHE_MISSES] > 0
    between_trials()
    together = build_trainer(builder, config, recipe, data=resident, folds=folds)
    names = [[layer.name for layer in engine.model.layers] for engine in together.engines]
    assert names[0] == names[1] == names[2]
    report = together.run_epoch().report()
    assert report[COMPILE_CACHE_MISSES] == 0  # the three folds run the one fold's programs
    assert report[COMPILE_CACHE_HITS] == alone[COMPILE_CACHE_MISSES]  # each loaded once, not once per fold
    assert report["split2_train_loss"] == alone["split2_train_loss"]


def _scaled_cnn(kind, scales, traced):
    """A build whose model multiplies its inputs by ``scales`` drawn under the fold's seed, a
    NumPy array (a constant in the traced graph) or a tensor (captured), or by 1.0 (``kind``
    None); each draw goes to ``scales``, each graph-mode training call to ``traced``."""
    import keras
    import tensorflow as tf

    class Scaled(keras.layers.Layer):
        def __init__(self, scale, **kwargs):
            super().__init__(**kwargs)
            self.scale = scale

        def call(self, inputs, training=False):
            if training and not tf.executing_eagerly():
                traced.append(self.name)
            return inputs * self.scale

    def build(hp):
        scale = np.float32(1.0) if kind is None else np.random.uniform(0.5, 1.5, size=(40, 1)).astype("float32")
        scales.append(scale)
        return keras.Sequential(
            [
                Scaled(tf.constant(scale) if kind == "tensor" else scale),
                keras.layers.Conv1D(4, 3, activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dropout(0.2),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )

    return build


def _side_by_side(
    build,
    data,
    folds,
    fold_ids=None,
    class_weight=None,
    inline_step=False,
    jit_compile="off",
    batch_size=16,
    graph_optimizer="light",
):
    config = {"batch_size": batch_size, "learning_rate": 1e-2, "optimizer": "adam"}
    train = TrainSpec(seed=0, class_weight=class_weight)
    choices = ExecutionChoices(
        jit_compile=jit_compile,
        layout="side_by_side",
        inline_step=inline_step,
        pad_last_batch=train.pad_last_batch,
        graph_optimizer=graph_optimizer,
    )
    recipe = TrainingRecipe(train, choices)
    resident = resident_data(data.fingerprint, data.x, data.y)
    return build_trainer(build, config, recipe, data=resident, folds=folds, fold_ids=fold_ids)


def _traced_epochs(trainer) -> list[int] | None:
    """Which traced epoch each fold of a side-by-side trainer runs (numbered by first use), or
    None where the folds' loops train in one execution."""
    epochs = trainer._executor.epochs
    if epochs is None:
        return None
    first_use: dict[int, int] = {}
    return [first_use.setdefault(id(epoch.function), len(first_use)) for epoch in epochs]


@pytest.fixture(scope="module")
def three_folds():
    data = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 150}))
    return data, make_folds(CVSpec(splitter="stratified", n_splits=3, seed=0), data).folds


@pytest.mark.parametrize("class_weight", [None, "balanced"])
def test_folds_side_by_side_run_one_training_step_and_train_as_each_fold_alone(three_folds, class_weight, monkeypatch):
    """The first fold's traced step serves the others (their variables and class weights passed
    in place of its own): their own steps, traced to compare, are its program, and each fold
    trains as it does alone, to the last bit."""
    from pipeline.engine import fold_engine

    shared = []
    original = fold_engine.shared_step
    monkeypatch.setattr(fold_engine, "shared_step", lambda *a, **k: shared.append(original(*a, **k)) or shared[-1])
    data, folds = three_folds
    together = _side_by_side(_scaled_cnn(None, [], []), data, folds, class_weight=class_weight)
    report = together.run_epoch().report()
    assert len(shared) == 2 and all(step is not None for step in shared)
    # The others' steps are never traced: their forward passes are, to be compared.
    assert [engine.traced_step.function.experimental_get_tracing_count() for engine in together.engines] == [1, 0, 0]
    assert [engine.traced_step.forward.experimental_get_tracing_count() for engine in together.engines] == [1, 1, 1]
    assert _traced_epochs(together) == [0, 0, 0]  # one epoch traced: each fold runs it on its variables
    alone = _side_by_side(_scaled_cnn(None, [], []), data, folds[2:], fold_ids=[2], class_weight=class_weight)
    alone_report = alone.run_epoch().report()
    assert report["split2_train_loss"] == alone_report["split2_train_loss"]
    assert report["split2_val_loss"] == alone_report["split2_val_loss"]


def test_xla_folds_with_the_last_batch_padded_share_one_epoch_and_train_as_in_their_own_loops(three_folds, monkeypatch):
    """Under XLA with the last batch padded, every fold's last launch has the batch's shape,
    whatever its remainder's length: one epoch traced for any remainder serves every fold, and
    each trains to the last bit as in its own loop in the execution (each fold's epoch traced
    with its own remainder)."""
    from pipeline.engine import side_by_side

    data, folds = three_folds
    # 80, 79 and 80 training samples: batches of 12, last ones of 8, 7 and 8, padded to 12.
    folds = [folds[0], dataclasses.replace(folds[1], train=folds[1].train[:-1]), folds[2]]
    shared = _side_by_side(_scaled_cnn(None, [], []), data, folds, jit_compile="on", batch_size=12)
    assert shared.plan.jit_compile and shared.plan.last_batch_padded
    report = shared.run_epoch().report()
    assert _traced_epochs(shared) == [0, 0, 0]
    monkeypatch.setattr(side_by_side, "shared_epochs", lambda engines: None)
    own_loops = _side_by_side(_scaled_cnn(None, [], []), data, folds, jit_compile="on", batch_size=12)
    own_report = own_loops.run_epoch().report()
    assert _traced_epochs(own_loops) is None
    for k in range(3):
        assert report[f"split{k}_train_loss"] == own_report[f"split{k}_train_loss"], k
        assert report[f"split{k}_val_loss"] == own_report[f"split{k}_val_loss"], k


def test_a_trial_whose_step_is_inlined_keeps_each_folds_loop_in_its_execution(three_folds):
    """Trials recorded with their step inlined in the epoch (``TrialPlan.step_inlined``) had each
    fold's loop in the execution, which TensorFlow's graph optimizer worked through, step and all:
    they keep it, so that they rerun to their recorded numbers."""
    data, folds = three_folds
    together = _side_by_side(_scaled_cnn(None, [], []), data, folds, inline_step=True)
    assert together.plan.step_inlined
    report = together.run_epoch().report()
    assert _traced_epochs(together) is None
    assert np.isfinite(report["split2_train_loss"])


def test_the_trials_functions_are_called_with_the_graph_optimizer_its_plan_records(three_folds):
    """``train.graph_optimizer``: light has TensorFlow's graph optimizer work through the trial's
    functions in one round without its TFG pipelines, full as TensorFlow does by default; each
    trial's own setting, whatever the trial before it in the process had. On this model both
    train to the same numbers to the last bit."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.eager import context

    data, folds = three_folds
    reports = {}
    # The last trainer only shows the setting switched back: it need not train.
    for graph_optimizer, trains in (("light", True), ("full", True), ("light", False)):
        trainer = _side_by_side(_scaled_cnn(None, [], []), data, folds, graph_optimizer=graph_optimizer)
        assert trainer.plan.graph_optimizer == graph_optimizer
        called_with = config_pb2.ConfigProto.FromString(context.context().function_call_options.config_proto_serialized)
        rewrite = called_with.graph_options.rewrite_options
        light = graph_optimizer == "light"
        assert (rewrite.meta_optimizer_iterations == rewriter_config_pb2.RewriterConfig.ONE) is light
        assert rewrite.disable_tfg_optimizer is light
        if trains:
            reports[graph_optimizer] = trainer.run_epoch().report()
    for k in range(3):
        for name in ("train_loss", "val_loss", "val_accuracy"):
            assert reports["light"][f"split{k}_{name}"] == reports["full"][f"split{k}_{name}"], (k, name)


@pytest.mark.parametrize("kind", ["array", "tensor"])
def test_a_fold_model_holding_numbers_of_its_own_trains_its_own_step(three_folds, kind, monkeypatch):
    """A build that draws numbers under the fold's seed and keeps them out of its variables (a
    NumPy array the trace bakes in as a constant; a tensor it captures) gets each fold's own step,
    not the first fold's: each fold trains with its own numbers, as it does alone."""
    from pipeline.engine import fold_engine

    shared = []
    original = fold_engine.shared_step
    monkeypatch.setattr(fold_engine, "shared_step", lambda *a, **k: shared.append(original(*a, **k)) or shared[-1])
    data, folds = three_folds
    scales, traced = [], []
    together = _side_by_side(_scaled_cnn(kind, scales, traced), data, folds)
    report = together.run_epoch().report()
    assert not np.array_equal(scales[0], scales[2])
    alone = _side_by_side(_scaled_cnn(kind, [], []), data, folds[2:], fold_ids=[2]).run_epoch().report()
    assert report["split2_train_loss"] == alone["split2_train_loss"]
    assert report["split2_val_loss"] == alone["split2_val_loss"]
    assert shared == [None, None]
    assert [engine.traced_step.function.experimental_get_tracing_count() for engine in together.engines] == [1, 1, 1]
    assert _traced_epochs(together) == [0, 1, 2]  # each fold's epoch, with its own step
    assert len(traced) == (3 if kind == "tensor" else 6)  # the forward passes compared, for the array


def _unseen_by_the_forward_pass(kind):
    """A build whose fold models differ where their forward passes do not show it: a gradient
    scaled, position by position, by numbers a ``tf.custom_gradient`` keeps in its Python function
    (``gradient``), which of two layers of one shape is frozen, chosen by a number drawn
    (``frozen``: the same variables of the same shapes, in the model and in the optimizer), or a
    kernel's max-norm constraint drawn (``constraint``, applied in the optimizer's update); each
    under the fold's seed. The index of each fold's frozen layer goes to the build's ``frozen``."""
    import keras
    import tensorflow as tf

    class ScaledGradient(keras.layers.Layer):
        def __init__(self, factors, **kwargs):
            super().__init__(**kwargs)
            self.factors = factors

        def call(self, inputs):
            @tf.custom_gradient
            def scaled(x):
                return tf.identity(x), lambda upstream: upstream * self.factors

            return scaled(inputs)

    frozen = []

    def build(hp):
        factors = np.random.uniform(0.1, 2.0, size=(38, 4)).astype("float32")
        model = keras.Sequential(
            [
                keras.Input((40, 1)),
                keras.layers.Conv1D(4, 3, activation="relu"),
                *([ScaledGradient(factors)] if kind == "gradient" else []),
                keras.layers.Flatten(),
                keras.layers.Dense(10, activation="relu"),
                keras.layers.Dense(
                    10,
                    activation="relu",
                    kernel_constraint=keras.constraints.MaxNorm(factors[0, 0] / 4) if kind == "constraint" else None,
                ),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        if kind == "frozen":
            frozen.append(-1 if factors[0, 0] > 1.15 else -2)  # seed 0: fold 0 freezes one, folds 1 and 2 the other
            model.layers[frozen[-1]].trainable = False
        return model

    build.frozen = frozen
    return build


@pytest.mark.parametrize("kind", ["gradient", "frozen", "constraint"])
def test_a_fold_model_differing_beyond_its_forward_pass_trains_its_own_step(three_folds, kind, monkeypatch):
    """The folds are compared by their forward passes; what the forward graph does not show, a
    Python gradient's numbers, which layers train or a weight constraint, keeps each fold on its
    own step, trained as it trains alone."""
    from pipeline.engine import fold_engine

    shared = []
    original = fold_engine.shared_step
    monkeypatch.setattr(fold_engine, "shared_step", lambda *a, **k: shared.append(original(*a, **k)) or shared[-1])
    data, folds = three_folds
    build = _unseen_by_the_forward_pass(kind)
    report = _side_by_side(build, data, folds).run_epoch().report()
    if kind == "frozen":
        assert build.frozen[0] != build.frozen[2]
    alone = _side_by_side(_unseen_by_the_forward_pass(kind), data, folds[2:], fold_ids=[2]).run_epoch().report()
    assert report["split2_train_loss"] == alone["split2_train_loss"]
    assert report["split2_val_loss"] == alone["split2_val_loss"]
    assert shared[1] is None


@pytest.mark.parametrize("stop_test", ["per_launch", "per_epoch"])
def test_a_fold_whose_own_number_moves_only_its_layer_state_trains_its_own_step(data_and_folds, stop_test):
    """A number ``build`` draws that moves only a layer's state (a running mean's momentum) shows
    in no loss or gradient: the check compares the state a step leaves, also where the plan keeps
    or drops each step's updates by a mask (the per-epoch stop test of a GPU), so the second fold
    keeps its own momentum."""
    import keras
    import tensorflow as tf

    class RunningMean(keras.layers.Layer):
        def __init__(self, momentum, **kwargs):
            super().__init__(**kwargs)
            self.momentum = momentum

        def build(self, input_shape):
            self.mean = self.add_weight(shape=(), initializer="zeros", trainable=False)

        def call(self, inputs, training=False):
            if training:
                self.mean.assign(self.mean * self.momentum + tf.reduce_mean(inputs) * (1 - self.momentum))
            return inputs

    def model(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential(
            [
                RunningMean(np.float32(np.random.uniform(0.1, 0.9))),
                keras.layers.Conv1D(4, 3),
                keras.layers.Flatten(),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )

    plan = dataclasses.replace(SEQUENTIAL_WITHOUT_XLA, stop_test=stop_test)
    loss = keras.losses.SparseCategoricalCrossentropy()
    first = fold_engine(data_and_folds, model(0), loss, plan=plan)
    first.train_epoch(0)  # its step traced where its launch is
    second = fold_engine(data_and_folds, model(1), loss, plan=plan, fold=1, template=first.traced_step)
    alone = fold_engine(data_and_folds, model(1), loss, plan=plan, fold=1)
    assert second.model.layers[0].momentum != first.model.layers[0].momentum
    assert second.train_epoch(0) == alone.train_epoch(0)
    assert second.model.layers[0].mean.numpy() == alone.model.layers[0].mean.numpy()


def test_cv_summary_uses_sklearn_vocabulary_and_population_std():
    summary = cv_summary([{"val_accuracy": 0.5}, {"val_accuracy": 0.7}, {"val_accuracy": 0.9}])
    assert summary["split0_val_accuracy"] == 0.5 and summary["split2_val_accuracy"] == 0.9
    assert summary["mean_val_accuracy"] == pytest.approx(0.7)
    assert summary["std_val_accuracy"] == pytest.approx(np.std([0.5, 0.7, 0.9]))


def test_fold_seeds_differ_per_fold_and_repeat_per_seed():
    assert fold_seed(0, 0) != fold_seed(0, 1)
    assert fold_seed(3, 1) == fold_seed(3, 1)


def test_an_epoch_reports_every_fold_and_the_cv_mean(data_and_folds):
    result = trainer(data_and_folds).run_epoch().report()
    assert result["epoch"] == 1
    for key in ("val_accuracy", "val_loss", "train_loss"):
        folds = [result[f"split{k}_{key}"] for k in range(2)]
        assert result[f"mean_{key}"] == pytest.approx(np.mean(folds))
    assert 0.0 <= result["mean_val_accuracy"] <= 1.0


def test_same_seed_gives_the_same_fold_losses(data_and_folds):
    first, second = trainer(data_and_folds, seed=4), trainer(data_and_folds, seed=4)
    runs = [[t.run_epoch().report() for _ in range(2)] for t in (first, second)]
    for a, b in zip(*runs):
        for k in range(2):
            assert a[f"split{k}_val_loss"] == pytest.approx(b[f"split{k}_val_loss"], rel=1e-5)
            assert a[f"split{k}_train_loss"] == pytest.approx(b[f"split{k}_train_loss"], rel=1e-5)
    other = trainer(data_and_folds, seed=5).run_epoch().report()
    assert other["split0_val_loss"] != pytest.approx(runs[0][0]["split0_val_loss"], rel=1e-6)


def test_state_round_trip_resumes_the_same_training(data_and_folds):
    original = trainer(data_and_folds, seed=1)
    original.run_epoch().report()
    state = original.state()
    restored = trainer(data_and_folds, seed=1)
    restored.load_state(state)
    assert restored.epoch == 1
    for a, b in zip(original.engines, restored.engines):
        for wa, wb in zip(a.model.weights, b.model.weights):
            np.testing.assert_array_equal(np.asarray(wa), np.asarray(wb))
        for va, vb in zip(a.optimizer.variables, b.optimizer.variables):
            np.testing.assert_array_equal(np.asarray(va), np.asarray(vb))
    # Both continue identically: the next epoch's shuffle depends on (seed, epoch) only.
    after_original, after_restored = original.run_epoch().report(), restored.run_epoch().report()
    assert after_restored["split0_val_loss"] == pytest.approx(after_original["split0_val_loss"], rel=1e-5)


def test_a_loss_of_the_researchers_own_is_traced_as_keras_fit_traces_it(data_and_folds):
    """Keras' fit traces its step without AutoGraph (do_not_convert), and so does the engine: a
    Python ``if`` on a tensor in a loss fails in both, rather than being turned into a graph
    condition that trains under foldsweep only."""
    import keras
    import tensorflow as tf

    def loss(y_true, y_pred):
        per_sample = keras.losses.sparse_categorical_crossentropy(y_true, y_pred)
        if tf.reduce_mean(per_sample) > 1e9:
            return per_sample * 0.0
        return per_sample

    data, _ = data_and_folds

    def model():
        return keras.Sequential(
            [
                keras.layers.Conv1D(4, 3),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )

    fitted = model()
    fitted.compile(optimizer="adam", loss=loss)
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
        fitted.fit(data.x[:64], data.y[:64], batch_size=32, epochs=1, verbose=0)
    engine = fold_engine(data_and_folds, model(), loss)
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
        engine.train_epoch(0)


def test_a_step_is_traced_once_for_an_epochs_full_batches_and_its_shorter_last_one(data_and_folds):
    """Keras' fit traces its train step with the batch dimension unknown, and so does the engine:
    one trace serves an epoch's full batches and its last, shorter one, under XLA too (which still
    compiles a program per batch size) and with foldsweep's dropout draws, whose shape is then
    known only when the step runs."""
    import keras

    traced_batches = []

    class TracedBatch(keras.layers.Layer):
        def call(self, inputs, training=False):
            if training:
                traced_batches.append(inputs.shape[0])
            return inputs

    def model():
        return keras.Sequential(
            [
                TracedBatch(),
                keras.layers.Conv1D(4, 3),
                keras.layers.Flatten(),
                keras.layers.Dropout(0.5),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )

    data, folds = data_and_folds
    fitted = model()
    fitted.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    fitted.fit(data.x[:100], data.y[:100], batch_size=32, epochs=2, verbose=0)  # 3 batches of 32, one of 4
    assert set(traced_batches) == {None}
    traced_batches.clear()
    assert len(folds[0].train) % 32
    plan = dataclasses.replace(SEQUENTIAL_WITHOUT_XLA, jit_compile=True, random_draws="counter")
    engine = fold_engine(data_and_folds, model(), keras.losses.sparse_categorical_crossentropy, plan=plan)
    losses = [engine.train_epoch(epoch) for epoch in range(2)]
    assert traced_batches == [None]
    assert np.isfinite(losses).all()
    assert int(engine.optimizer.iterations.numpy()) == 2 * -(-len(folds[0].train) // 32)  # the short batches too


def test_a_trials_config_is_resolved_once_into_named_parts():
    """What a trial trains with, resolved from its config: a config already resolved (the
    runner's, handed to ``build_trainer``) is not resolved again."""
    from pipeline.engine.recipe import TrainingParams, TrialConfig

    recipe = TrainingRecipe(TrainSpec(epochs=7))
    config = {**MODEL, "batch_size": 16, "learning_rate": 0.01, "optimizer": "sgd"}
    resolved = recipe.resolve(config)
    used = {**config, "clipping": "none"}  # the values the trial uses, its defaults included
    assert resolved == TrialConfig(
        config=used,
        model_values=used,
        epochs=7,
        params=TrainingParams(
            batch_size=16, learning_rate=0.01, optimizer="sgd", clipping="none", clip_threshold=1.0, shuffle=True
        ),
    )
    assert recipe.resolve(resolved) is resolved
    assert recipe.resolve({**config, "epochs": 3}).epochs == 3


def _compiling_adam(hp):
    import keras

    model = keras.Sequential([keras.layers.Conv1D(4, 3), keras.layers.Flatten(), keras.layers.Dense(10, "softmax")])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@pytest.mark.parametrize(
    ("searched", "kind", "clipnorm"),
    [
        ({"optimizer": "sgd"}, "SGD", None),  # the spec replaces the build's Adam
        ({"clipping": "norm", "clip_threshold": 0.5}, "Adam", 0.5),  # the spec clips the build's Adam
        ({}, "Adam", None),  # the build's own, kept as it was compiled
    ],
    ids=["replaced", "clipped", "own"],
)
def test_the_refit_model_is_saved_with_the_optimizer_that_trained_it(
    data_and_folds, tmp_path, searched, kind, clipnorm
):
    """As fit leaves a model: it loads without Keras' warning about optimizer state that does not
    fit, with the optimizer's class, clipping and step count that trained it, and the build's
    loss and metrics."""
    import warnings

    import keras

    data, folds = data_and_folds
    train = TrainSpec(seed=0, epochs=1)
    config = {"batch_size": 32, "learning_rate": 1e-3, "optimizer": "adam", "clipping": "none", **searched}
    recipe = TrainingRecipe(train, spec_names=frozenset(searched))
    resident = resident_data(data.fingerprint, data.x, data.y)
    trainer = build_trainer(_compiling_adam, config, recipe, data=resident, folds=folds[:1])
    trainer.run_epoch()
    model = trainer.model_with_trained_optimizer()
    model.save(tmp_path / "refit.keras")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Skipping variable loading")
        loaded = keras.saving.load_model(tmp_path / "refit.keras")
    optimizer = loaded.optimizer
    assert type(optimizer).__name__ == kind and optimizer.clipnorm == clipnorm
    assert int(optimizer.iterations) == -(-len(folds[0].train) // 32)
    trained = trainer.engines[0].optimizer.variables
    assert len(optimizer.variables) == len(trained)
    assert all(np.array_equal(kept.numpy(), value.numpy()) for kept, value in zip(optimizer.variables, trained))
    assert loaded.loss == "sparse_categorical_crossentropy"
    assert loaded.get_compile_config()["metrics"] == ["accuracy"]


_KEPT: dict[str, object] = {}


def _kept_between_calls(hp):  # a build that keeps its model: every fold would train the one model
    import keras

    if "model" not in _KEPT:
        _KEPT["model"] = keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(10, "softmax")])
    return _KEPT["model"]


def test_fold_models_that_share_what_they_train_are_refused(data_and_folds):
    from pipeline.base.errors import ExperimentError

    data, folds = data_and_folds
    config = {"batch_size": 32, "learning_rate": 1e-3, "optimizer": "adam", "clipping": "none"}
    resident = resident_data(data.fingerprint, data.x, data.y)
    with pytest.raises(ExperimentError, match="share 2 trainable variables: .* would not be cross-validation"):
        build_trainer(_kept_between_calls, config, TrainingRecipe(TrainSpec(seed=0)), data=resident, folds=folds)


def _uncompiled(hp):
    import keras

    return keras.Sequential([keras.layers.Conv1D(4, 3), keras.layers.Flatten(), keras.layers.Dense(10, "softmax")])


def test_a_refit_model_its_build_left_uncompiled_is_saved_compiled_with_what_trained_and_scored_it(
    data_and_folds, tmp_path
):
    """As fit leaves a model it trained: with foldsweep's optimizer in its trained state, the loss
    and the metrics it was scored by, so that the saved model's evaluate gives the scores foldsweep
    took on the same samples."""
    import keras

    data, folds = data_and_folds
    train = TrainSpec(seed=0, epochs=1, metrics=("sparse_top_k_categorical_accuracy",))
    config = {"batch_size": 32, "learning_rate": 1e-3, "optimizer": "adam", "clipping": "none"}
    resident = resident_data(data.fingerprint, data.x, data.y)
    trainer = build_trainer(_uncompiled, config, TrainingRecipe(train), data=resident, folds=folds[:1])
    (scores,) = trainer.run_epoch().folds
    trainer.model_with_trained_optimizer().save(tmp_path / "refit.keras")
    loaded = keras.saving.load_model(tmp_path / "refit.keras")
    assert type(loaded.optimizer).__name__ == "Adam"
    assert int(loaded.optimizer.iterations) == -(-len(folds[0].train) // 32)
    val = folds[0].val
    evaluated = loaded.evaluate(data.x[val], data.y[val], batch_size=32, verbose=0, return_dict=True)
    assert evaluated["accuracy"] == pytest.approx(scores.val_accuracy, abs=1e-6)
    assert evaluated["loss"] == pytest.approx(scores.val_loss, rel=1e-5)
    top_k = scores.metrics["sparse_top_k_categorical_accuracy"]
    assert evaluated["sparse_top_k_categorical_accuracy"] == pytest.approx(float(top_k), abs=1e-6)
