"""How a trial executes, decided once (``pipeline.contract.plan``): XLA, steps per launch, the folds'
layout and its reason, thread pools. Pure decisions: no Ray, no training."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeline.contract.compile_cost import COMPILE_S, CompileCosts, computing_layers, multiply_adds
from pipeline.contract.plan import (
    GPU_UNROLL_MAX_BATCH,
    GPU_UNROLL_MIN_PLANNED_STEPS,
    STACK_MAX_BATCH,
    UNROLL_MAX_BATCH,
    UNROLLED_STEPS,
    XLA_MAX_BATCH_ON_CPU,
    ExecutionChoices,
    ThreadPlan,
    TrialPlan,
    plan_differences,
    plan_threads,
    plan_trial,
    replay_choices,
    shared_variable_count,
)


class Layer:
    def _flatten_layers(self, include_self=True, recursive=True):
        return [self] if include_self else []


class RandomLayer(Layer):
    """What Keras' random layers hold: a SeedGenerator, Dropout's as ``seed_generator``, RandomFlip's as
    ``generator``."""

    def __init__(self, attribute: str = "seed_generator"):
        from keras.random import SeedGenerator

        setattr(self, attribute, SeedGenerator(0))


class Model:
    """What the plan looks at of a model: its layers and its variables."""

    def __init__(self, *layers, variables=None):
        self.layers = layers or (Layer(),)
        self.variables = variables if variables is not None else [object()]

    def _flatten_layers(self, include_self=True, recursive=True):
        return [self, *self.layers] if include_self else list(self.layers)


@pytest.fixture(autouse=True)
def xla_compiles_as_cheaply_as_the_graph(request, monkeypatch):
    """The rules other than the compile weighing are tested with XLA's compile costing what the
    graph's does, so that XLA pays from the first step; the weighing's tests (``test_compile_*``)
    keep the calibrated costs."""
    if not request.function.__name__.startswith("test_compile_"):
        monkeypatch.setitem(COMPILE_S, "xla", COMPILE_S["graph"])
        monkeypatch.setitem(COMPILE_S, "stacked", COMPILE_S["graph"])


CPU, GPU = "/CPU:0", "/GPU:0"
ONE_THREAD, TWO_THREADS = ThreadPlan(intra_op=1, inter_op=1), ThreadPlan(intra_op=2, inter_op=3)
# 3 folds of 300 samples: 37 steps per epoch at batch 8, far below the unrolling threshold.
SIZES = [300, 300, 300]


def plan(
    choices=ExecutionChoices(),
    *,
    models=None,
    threads=ONE_THREAD,
    device=CPU,
    batch_size=8,
    epochs=2,
    sizes=SIZES,
    blocker=None,
    xla_blocker=None,
    tf32=False,
    keras_loss=True,
    graph_vector_width="narrower",
) -> TrialPlan:
    asked = []
    traced = []

    def without_xla(random_draws):
        traced.append(random_draws)
        return xla_blocker

    def stacking_blocker(jit_compile, random_draws, convolutions):
        asked.append(jit_compile)
        assert convolutions == ("grouped" if device == GPU else "patches")
        return blocker if jit_compile else "the step runs without XLA"

    models = models() if callable(models) else models
    result = plan_trial(
        choices,
        models=models or [Model() for _ in sizes],
        threads=threads,
        device=device,
        batch_size=batch_size,
        train_sizes=sizes,
        planned_epochs=epochs,
        stacking_blocker=stacking_blocker,
        xla_blocker=without_xla,
        tf32=tf32,
        keras_loss=keras_loss,
        graph_vector_width=graph_vector_width,
    )
    # The blocker runs the models (a forward check): asked only when stacking is wanted.
    assert len(asked) == (1 if result.layout == "stacked" or "not stacked" in result.reason else 0)
    # The XLA blocker traces a model: asked only when XLA is wanted.
    assert len(traced) == (1 if result.jit_compile or "; without XLA: " in result.reason else 0)
    assert all(random_draws == result.random_draws for random_draws in traced)  # it traces with the plan's draws
    return result


@pytest.mark.parametrize(
    "choices, overrides, layout, reason",
    [
        (ExecutionChoices(), {}, "stacked", "fused: 3 folds in one execution, stacked into one XLA program per step"),
        (
            ExecutionChoices(fused="on"),
            {},
            "stacked",
            "fused: 3 folds in one execution (train.fused is true), stacked into one XLA program per step",
        ),
        (
            ExecutionChoices(),
            {"threads": TWO_THREADS},
            "side_by_side",
            "fused: 3 folds in one execution, side by side (2 compute threads)",
        ),
        (
            ExecutionChoices(),
            {"batch_size": 64},
            "side_by_side",
            f"fused: 3 folds in one execution, side by side (batch 64: stacking pays up to batch {STACK_MAX_BATCH})",
        ),
        (
            ExecutionChoices(),
            {"blocker": "BatchNormalization layers have no stacked form"},
            "side_by_side",
            "fused: 3 folds in one execution, side by side (not stacked: BatchNormalization layers have no stacked form)",
        ),
        # Made when the test runs: a SeedGenerator made while collecting would start TensorFlow before
        # the suite sizes its thread pools (conftest's pytest_collection_finish).
        (
            ExecutionChoices(),
            {"models": lambda: [Model(RandomLayer()) for _ in SIZES]},
            "side_by_side",
            "fused: 3 folds in one execution, side by side (not stacked: the step runs without XLA)",
        ),
        (
            ExecutionChoices(),
            {"threads": TWO_THREADS, "sizes": [300] * 15},
            "stacked",
            "fused: 15 folds in one execution, stacked into one XLA program per step",
        ),
        (
            ExecutionChoices(),
            {"threads": TWO_THREADS, "sizes": [300] * 8},
            "side_by_side",
            "fused: 8 folds in one execution, side by side (2 compute threads)",
        ),
        (
            ExecutionChoices(),
            {"threads": TWO_THREADS, "sizes": [300] * 15, "batch_size": 64},
            "side_by_side",
            f"fused: 15 folds in one execution, side by side (batch 64: stacking pays up to batch {STACK_MAX_BATCH})",
        ),
        (
            ExecutionChoices(),
            {"threads": TWO_THREADS, "device": GPU},
            "stacked",
            "fused: 3 folds in one execution, stacked into one XLA program per step",
        ),
        (
            ExecutionChoices(layout="side_by_side"),
            {},
            "side_by_side",
            "fused: 3 folds in one execution, side by side (1 compute thread)",
        ),
        (
            ExecutionChoices(layout="stacked"),
            {"threads": TWO_THREADS, "batch_size": 256},
            "stacked",
            "fused: 3 folds in one execution, stacked into one XLA program per step",
        ),
        (ExecutionChoices(fused="off"), {}, "sequential", "unfused: train.fused is false"),
        (ExecutionChoices(fused="on"), {"sizes": [300]}, "sequential", "unfused: one fold to train"),
        (
            ExecutionChoices(fused="on", eager=True),
            {},
            "sequential",
            "unfused: eager execution (debugging) runs each fold op by op",
        ),
        (
            ExecutionChoices(fused="on", check_numerics=True),
            {},
            "sequential",
            "unfused: numeric checking runs the folds one after another, so that the first non-finite value is the same "
            "in every run",
        ),
    ],
)
def test_layout_decision_and_its_reason(choices, overrides, layout, reason):
    decided = plan(choices, **overrides)
    assert (decided.layout, decided.reason) == (layout, reason)
    assert decided.fused == (layout != "sequential")


def test_fold_models_sharing_variables_are_not_fused():
    shared = [object(), object()]
    models = [Model(variables=[*shared, object()]) for _ in SIZES]
    assert shared_variable_count(models) == 2
    decided = plan(ExecutionChoices(fused="on"), models=models)
    assert decided.layout == "sequential" and "share 2 variables" in decided.reason


def test_xla_follows_device_batch_size_and_random_layers_and_can_be_forced():
    noisy = [Model(RandomLayer()) for _ in SIZES]
    assert plan().jit_compile and plan(batch_size=XLA_MAX_BATCH_ON_CPU).jit_compile
    assert not plan(batch_size=XLA_MAX_BATCH_ON_CPU * 2).jit_compile
    # Measured slower than TensorFlow's graph on CPU from batch 32, and ~1 s more to compile per fold.
    assert not plan(batch_size=32).jit_compile and plan(ExecutionChoices(jit_compile="on"), batch_size=32).jit_compile
    # A form only XLA executes, forced, takes XLA past the batch limit.
    assert plan(ExecutionChoices(layout="stacked"), batch_size=256).jit_compile
    assert plan(ExecutionChoices(steps_per_launch=8), batch_size=64).jit_compile
    assert plan(batch_size=1024, device=GPU).jit_compile
    assert not plan(models=noisy).jit_compile and plan(models=noisy, device=GPU).jit_compile
    assert not plan(ExecutionChoices(jit_compile="off")).jit_compile
    assert plan(ExecutionChoices(jit_compile="on"), batch_size=1024, models=noisy).jit_compile
    assert not plan(models=[Model(Layer(), RandomLayer("generator")) for _ in SIZES]).jit_compile


def test_a_model_with_an_op_xla_cannot_compile_runs_without_xla_on_every_device_or_is_refused_when_forced():
    from pipeline.base.errors import ExperimentError

    op = "layer 'random_rotation' (RandomRotation) runs ImageProjectiveTransformV3, an op XLA has no kernel for"
    for device, threads in ((GPU, TWO_THREADS), (CPU, ONE_THREAD)):
        decided = plan(device=device, threads=threads, xla_blocker=op)
        assert not decided.jit_compile and decided.layout != "stacked"
        assert decided.reason.endswith(f"; without XLA: {op}")
    assert plan(device=GPU, xla_blocker=None).jit_compile
    # Not asked where XLA is not wanted (it traces the model).
    assert not plan(ExecutionChoices(jit_compile="off"), xla_blocker=op).jit_compile
    with pytest.raises(ExperimentError, match=r"train.jit_compile is true, but .* ImageProjectiveTransformV3"):
        plan(ExecutionChoices(jit_compile="on"), device=GPU, xla_blocker=op)


def test_random_layers_draw_foldsweeps_numbers_where_it_can_draw_every_one_and_compile_as_any_layer():
    import keras

    def models(*layers):
        return [Model(*layers) for _ in SIZES]

    drawn = models(keras.layers.Dropout(0.2), keras.layers.GaussianNoise(0.1))
    decided = plan(models=drawn)
    assert decided.random_draws == "counter" and decided.jit_compile and decided.layout == "stacked"
    assert not plan(models=drawn, batch_size=XLA_MAX_BATCH_ON_CPU * 2).jit_compile  # the batch-size rule alone
    # A layer foldsweep does not draw for (an augmentation layer, a custom one) keeps Keras' generator.
    mixed = plan(models=models(keras.layers.Dropout(0.2), RandomLayer()))
    assert mixed.random_draws == "keras" and not mixed.jit_compile
    assert plan().random_draws == "none"
    # A plan recorded before foldsweep drew its own numbers replays with Keras' generator.
    recorded = plan(models=drawn).as_dict()
    del recorded["random_draws"]
    old = TrialPlan.from_dict(recorded)
    assert old.random_draws == "keras"
    replayed = plan(replay_choices(old), models=drawn)
    assert replayed.random_draws == "keras" and replayed.jit_compile  # the recorded XLA, forced
    assert plan_differences(old, replayed) == []
    assert plan_differences(old, decided) == ["random draws keras -> counter"]
    assert replay_choices(plan()).random_draws == "auto"
    assert plan_differences(TrialPlan.from_dict({**plan().as_dict(), "random_draws": "keras"}), plan()) == []


def test_models_that_convolve_images_keep_off_xla_on_cpu_and_call_their_step_once_optimized():
    import keras

    class OwnConvolution(keras.layers.Conv2D):
        pass

    def models(*layers):
        return [Model(*layers) for _ in SIZES]

    for layer in (keras.layers.Conv2D(4, 3), keras.layers.DepthwiseConv2D(3), OwnConvolution(4, 3)):
        on_cpu = plan(models=models(layer), batch_size=8)
        assert not on_cpu.jit_compile and not on_cpu.step_inlined
        assert plan(models=models(layer), device=GPU).jit_compile
        assert plan(ExecutionChoices(jit_compile="on"), models=models(layer)).jit_compile
    nested = Model(keras.Sequential([keras.Input((8, 8, 3)), keras.layers.SeparableConv2D(4, 3)]))
    nested._flatten_layers = lambda **kwargs: nested.layers[0]._flatten_layers(**kwargs)
    assert not plan(models=[nested] * 3).jit_compile
    assert plan(models=models(keras.layers.Conv1D(4, 3))).jit_compile
    # Augmentation draws foldsweep's numbers (and compiles) where nothing convolves images.
    augmented = plan(models=models(keras.layers.RandomFlip(), keras.layers.RandomContrast(0.2)))
    assert augmented.random_draws == "counter" and augmented.jit_compile

    # train.inline_step: the step inlined at each call, as plans recorded before had it.
    image = models(keras.layers.Conv2D(4, 3))
    inlined = plan(ExecutionChoices(inline_step=True), models=image)
    assert inlined.step_inlined and not plan(ExecutionChoices(inline_step=True), models=models()).step_inlined
    recorded = plan(models=image).as_dict()
    del recorded["step_inlined"]
    old = TrialPlan.from_dict(recorded)
    assert old.step_inlined
    assert plan(replay_choices(old), models=image).step_inlined
    assert plan_differences(old, plan(models=image)) == ["step inlined on -> off"]
    assert plan_differences(old, plan(replay_choices(old), models=image)) == []


def quickstart_net():
    """The quickstart's model (``experiments/mnist1d_cnn.py``) as its best trial builds it."""
    from pipeline.inputs.hypermodel import build_model, load_builder

    build = load_builder(Path(__file__).resolve().parents[1] / "experiments" / "mnist1d_cnn.py", "build")
    return build_model(build, {"conv_layers": 3, "filters": 64, "kernel_size": 5})


def fewest_planned_steps(
    form, over, *, layers, parallel, n_folds=3, batch_size=8, multiply_adds=0, graph_vector_width="narrower"
):
    """The fewest planned steps per fold from which ``form`` pays over ``over``."""
    costs = CompileCosts(layers, batch_size, multiply_adds, graph_vector_width)
    low, high = 1, 10**8
    while low < high:
        middle = (low + high) // 2
        if costs.pays(form, over, fold_steps=n_folds * middle, parallel=parallel):
            high = middle
        else:
            low = middle + 1
    return low


def test_steps_per_launch_unrolls_only_where_the_planned_steps_win_its_compile_back():
    # The fake model has one computing layer; stacked folds (one compute thread) run on one core.
    enough = fewest_planned_steps("unrolled", "xla", layers=1, parallel=1)
    # planned steps per fold = epochs * smallest fold // batch size
    assert plan(sizes=[enough * 8] * 3, epochs=1).steps_per_launch == UNROLLED_STEPS
    assert plan(sizes=[(enough - 1) * 8] * 3, epochs=1).steps_per_launch == 1
    many = [enough * UNROLL_MAX_BATCH] * 3
    # Above XLA's batch limit on CPU only a forced XLA unrolls, up to its own limit.
    assert plan(batch_size=XLA_MAX_BATCH_ON_CPU + 1, sizes=many, epochs=1).steps_per_launch == 1
    xla = ExecutionChoices(jit_compile="on")
    assert plan(xla, batch_size=UNROLL_MAX_BATCH, sizes=many, epochs=1).steps_per_launch == UNROLLED_STEPS
    assert plan(xla, batch_size=UNROLL_MAX_BATCH + 1, sizes=many, epochs=1).steps_per_launch == 1
    assert plan(ExecutionChoices(steps_per_launch=3), batch_size=128).steps_per_launch == 3
    assert plan(ExecutionChoices(steps_per_launch=3, jit_compile="off")).steps_per_launch == 1  # nothing to unroll
    assert plan(ExecutionChoices(steps_per_launch=3, eager=True)).steps_per_launch == 1


def test_compile_costs_grow_with_the_model_and_its_form():
    small, deep = CompileCosts(5, 8), CompileCosts(150, 8)
    for costs in (small, deep):
        assert costs.compile_s("stacked") < costs.compile_s("xla") < costs.compile_s("unrolled")
        assert costs.saved_s("graph", fold_steps=100) == 0 < costs.saved_s("xla", fold_steps=100)
        assert costs.saved_s("xla", fold_steps=100) < costs.saved_s("unrolled", fold_steps=100)
    assert deep.compile_s("xla") > small.compile_s("xla") and deep.compile_s("graph") > small.compile_s("graph")
    # Per layer, XLA saves as much as it costs to compile: what decides is its fixed compile cost,
    # so a small model needs more steps to win it back; two cores shorten what they save by half.
    assert fewest_planned_steps("xla", "graph", layers=150, parallel=2) < fewest_planned_steps(
        "xla", "graph", layers=5, parallel=2
    )
    on_two = fewest_planned_steps("xla", "graph", layers=19, parallel=2)
    assert abs(on_two - 2 * fewest_planned_steps("xla", "graph", layers=19, parallel=1)) <= 1


def test_compile_weighing_keeps_a_short_trial_off_xla_and_records_the_estimate():
    layers = 20
    deep = [Model(*[Layer() for _ in range(layers)]) for _ in SIZES]
    assert computing_layers(deep[0]) == layers
    enough = fewest_planned_steps("xla", "graph", layers=layers, parallel=2)
    short = plan(models=deep, threads=TWO_THREADS, batch_size=16, sizes=[(enough - 1) * 16] * 3, epochs=1)
    long = plan(models=deep, threads=TWO_THREADS, batch_size=16, sizes=[enough * 16] * 3, epochs=1)
    assert not short.jit_compile and long.jit_compile and long.steps_per_launch == 1
    costs = CompileCosts(layers, 16)
    assert short.reason.endswith(
        f"; without XLA: its compile (~{costs.compile_s('xla'):.0f} s estimated for {layers} layers, "
        f"~{costs.compile_s('graph'):.0f} s without) would cost more than XLA saves in {enough - 1} steps per fold"
    )
    assert short.compile_estimate_s == round(costs.compile_s("graph"), 1)
    assert long.compile_estimate_s == round(costs.compile_s("xla"), 1)
    # Stacked folds (one core) compile one program for all, for a little more than the graph's, and
    # save less per step than XLA side by side, less the larger the batch: they pay from the planned
    # steps that win that back, and a shorter trial runs without XLA.
    shallow = [Model(*[Layer() for _ in range(5)]) for _ in SIZES]
    stacks = fewest_planned_steps("stacked", "graph", layers=5, parallel=1)
    stacked = plan(models=shallow, sizes=[stacks * 8] * 3, epochs=1)
    assert stacked.layout == "stacked"
    assert stacked.compile_estimate_s == round(CompileCosts(5, 8).compile_s("stacked"), 1)
    too_short = plan(models=shallow, sizes=[(stacks - 1) * 8] * 3, epochs=1)
    assert too_short.layout == "side_by_side" and not too_short.jit_compile
    assert f"would cost more than its stacked folds save in {stacks - 1} steps per fold" in too_short.reason
    # Against the graph's AVX-512 kernels, what stacking saves falls with a batch's multiply-adds:
    # such a trial needs more steps to win its compile back, the more the larger its batch.
    against_avx512 = {"layers": 5, "parallel": 1, "graph_vector_width": "avx512"}
    assert (
        fewest_planned_steps("stacked", "graph", **against_avx512)
        < fewest_planned_steps("stacked", "graph", multiply_adds=100_000, **against_avx512)
        < fewest_planned_steps("stacked", "graph", multiply_adds=100_000, batch_size=16, **against_avx512)
    )
    # The quickstart's best net (3 convolutions of 64 filters of width 5: 10 layers, 648,320
    # multiply-adds per sample) at batch 16 (folds of 2,666-2,667 samples): stacked, it wins its
    # compile back over 20 epochs against narrower graph kernels, not against AVX-512 ones, where
    # the graph side by side trained as fast; nor over 2 epochs.
    net = [quickstart_net() for _ in SIZES]
    assert computing_layers(net[0]) == 10 and multiply_adds(net[0]) == 648_320
    folds = [2666, 2667, 2667]
    assert plan(models=net, batch_size=16, sizes=folds, epochs=20).layout == "stacked"
    wide_vectors = plan(models=net, batch_size=16, sizes=folds, epochs=20, graph_vector_width="avx512")
    assert wide_vectors.layout == "side_by_side" and not wide_vectors.jit_compile
    assert wide_vectors.reason.endswith(
        "would cost more than its stacked folds save against the graph's AVX-512 kernels in 3332 steps per fold"
    )
    short_run = plan(models=net, batch_size=16, sizes=folds, epochs=2)
    assert short_run.layout == "side_by_side" and not short_run.jit_compile
    # Where the stacked form is refused, XLA is weighed again as the side-by-side step it becomes,
    # which on one core needs more steps than stacking at 30 layers.
    deeper = [Model(*[Layer() for _ in range(30)]) for _ in SIZES]
    stacks_deeper = fewest_planned_steps("stacked", "graph", layers=30, parallel=1)
    assert fewest_planned_steps("xla", "graph", layers=30, parallel=1) > stacks_deeper
    assert plan(models=deeper, sizes=[stacks_deeper * 8] * 3, epochs=1).layout == "stacked"
    refused = plan(
        models=deeper, sizes=[stacks_deeper * 8] * 3, epochs=1, blocker="BatchNormalization layers have no stacked form"
    )
    assert refused.layout == "side_by_side" and not refused.jit_compile
    assert "; without XLA: its compile" in refused.reason
    # Forced XLA, and the GPU, are not weighed.
    assert plan(ExecutionChoices(jit_compile="on"), models=deep, threads=TWO_THREADS, batch_size=32).jit_compile
    assert plan(models=deep, device=GPU, threads=TWO_THREADS, batch_size=32).jit_compile
    # The estimate is recorded, and a plan recorded before it reads None and replays the same.
    assert TrialPlan.from_dict(json.loads(json.dumps(short.as_dict()))) == short
    recorded = long.as_dict()
    del recorded["compile_estimate_s"]
    old = TrialPlan.from_dict(recorded)
    assert old.compile_estimate_s is None
    replayed = plan(replay_choices(old), models=deep, threads=TWO_THREADS, batch_size=32, epochs=1)
    assert replayed.jit_compile and plan_differences(old, replayed) == []


def test_compile_estimate_counts_a_keras_models_computing_layers_nested_models_walked_into():
    import keras

    backbone = keras.Sequential([keras.layers.Conv1D(4, 3), keras.layers.ReLU()], name="backbone")
    inputs = keras.Input((16, 1))
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(backbone(inputs)))
    assert computing_layers(keras.Model(inputs, outputs)) == 4  # Conv1D, ReLU, pooling, Dense
    assert computing_layers(keras.Sequential([keras.layers.Dense(3)])) == 1


def test_threads_give_each_fused_fold_loop_an_executor_thread_within_the_trials_cpus():
    def threads(cpus, n_folds=3, **choices):
        planned = plan_threads(ExecutionChoices(**choices), cpus=cpus, n_folds=n_folds)
        return planned.intra_op, planned.inter_op

    # (intra-op, inter-op): compute threads follow resources.cpu; executor threads follow the loops.
    assert threads(2) == (2, 3) and threads(4, n_folds=5) == (4, 5)
    assert threads(2, fused="off") == (2, 1)  # unfused: one loop, one executor thread
    assert threads(2, n_folds=1) == (2, 1)
    assert threads(2, eager=True) == (2, 1) and threads(2, check_numerics=True) == (2, 1)
    assert threads(2, layout="stacked") == (2, 1)  # one XLA program: one loop
    assert threads(1) == (1, 1) and threads(0.5) == (1, 1)  # one CPU: folds stack or take turns


def test_a_plan_survives_its_record():
    decided = plan(threads=TWO_THREADS)
    assert TrialPlan.from_dict(json.loads(json.dumps(decided.as_dict()))) == decided
    assert decided.threads.describe() == "intra-op 2, inter-op 3"
    assert ThreadPlan(0, 0).describe() == "intra-op default, inter-op default"


def test_a_plan_recorded_before_the_layouts_were_renamed_reads_its_unfused_layout_as_sequential():
    sequential = plan(ExecutionChoices(fused="off"))
    recorded = TrialPlan.from_dict({**sequential.as_dict(), "layout": "unfused"})
    assert recorded == sequential and recorded.layout == "sequential" and not recorded.fused
    assert replay_choices(recorded) == ExecutionChoices(
        jit_compile="on" if sequential.jit_compile else "off",
        fused="off",
        steps_per_launch=1,
        layout="auto",
        random_draws="auto",
    )
    assert plan_differences(recorded, sequential) == []


def test_the_gpu_plan_tests_for_a_failed_fold_once_per_epoch():
    assert plan(device=GPU).stop_test == "per_epoch" and plan(device=GPU, threads=TWO_THREADS).stop_test == "per_epoch"
    assert plan().stop_test == "per_launch"
    # Debugging runs op by op, where stopping at the failing step is the point.
    assert plan(ExecutionChoices(eager=True), device=GPU).stop_test == "per_launch"
    assert plan(ExecutionChoices(check_numerics=True), device=GPU).stop_test == "per_launch"
    # A plan recorded before the rule tested before every launch; the masked step trains the same
    # numbers, so the test alone is no difference a rerun reports.
    recorded = plan(device=GPU).as_dict()
    del recorded["stop_test"]
    assert TrialPlan.from_dict(recorded).stop_test == "per_launch"
    assert plan_differences(TrialPlan.from_dict(recorded), plan(device=GPU)) == []


def test_the_gpu_rules_stack_at_every_batch_size_with_grouped_convolutions_and_unroll_to_their_thresholds():
    for batch_size in (8, 64, 512):
        decided = plan(device=GPU, threads=TWO_THREADS, batch_size=batch_size)
        assert decided.layout == "stacked" and decided.stacked_convolutions == "grouped"
    assert plan(batch_size=64).layout == "side_by_side" and plan().stacked_convolutions == "patches"
    assert plan(ExecutionChoices(layout="side_by_side"), device=GPU).layout == "side_by_side"
    # Steps per launch: the GPU's own thresholds (planned steps per fold = epochs * 300 // batch).
    enough = GPU_UNROLL_MIN_PLANNED_STEPS * 8 // 300 + 1
    assert plan(device=GPU, epochs=enough).steps_per_launch == UNROLLED_STEPS
    assert plan(device=GPU, epochs=enough - 2).steps_per_launch == 1 and plan(epochs=enough).steps_per_launch == 1
    assert enough * 300 // 8 < fewest_planned_steps("unrolled", "xla", layers=1, parallel=1)  # the CPU's
    many = [GPU_UNROLL_MIN_PLANNED_STEPS * GPU_UNROLL_MAX_BATCH] * 3
    assert plan(device=GPU, batch_size=GPU_UNROLL_MAX_BATCH, sizes=many, epochs=1).steps_per_launch == UNROLLED_STEPS
    assert plan(device=GPU, batch_size=GPU_UNROLL_MAX_BATCH * 2, sizes=many, epochs=1).steps_per_launch == 1


def test_tf32_is_recorded_for_a_gpu_and_a_change_of_it_or_of_the_stacked_convolutions_is_a_difference():
    on, off = plan(device=GPU, tf32=True), plan(device=GPU)
    assert on.tf32 and not off.tf32 and not plan(tf32=True).tf32  # TF32 is a GPU's
    assert TrialPlan.from_dict(json.loads(json.dumps(on.as_dict()))) == on
    assert plan_differences(on, off) == ["TF32 on -> off"]
    patches = TrialPlan.from_dict({**on.as_dict(), "stacked_convolutions": "patches"})
    assert plan_differences(patches, on) == ["stacked convolutions patches -> grouped"]
    old = dict(plan().as_dict())
    del old["stacked_convolutions"], old["tf32"]
    assert TrialPlan.from_dict(old) == plan()


def test_a_loss_scale_factor_is_recorded_and_a_plan_from_before_its_cancelling_says_so():
    # The optimizer's loss_scale_factor is cancelled as fit cancels it; a plan recorded before
    # (none in it) was trained with the gradients divided by the factor alone.
    cancelled = dataclasses.replace(plan(), loss_scale_factor=128.0)
    recorded = cancelled.as_dict()
    assert json.loads(json.dumps(recorded))["loss_scale_factor"] == 128.0
    del recorded["loss_scale_factor"]
    old = TrialPlan.from_dict(recorded)
    assert old.loss_scale_factor is None
    assert plan_differences(old, cancelled) == [
        "the optimizer's loss_scale_factor 128.0 cancelled as fit does (the recorded trial divided its gradients by it)"
    ]
    assert plan_differences(cancelled, cancelled) == [] and plan_differences(old, plan()) == []


def test_variables_left_out_of_weight_decay_are_recorded_and_a_plan_from_before_says_so():
    excluding = dataclasses.replace(plan(), decay_exclusions=True)
    recorded = excluding.as_dict()
    del recorded["decay_exclusions"]
    old = TrialPlan.from_dict(recorded)
    assert old.decay_exclusions is False
    assert plan_differences(old, excluding) == [
        "the optimizer's variables left out of weight decay as fit leaves them (the recorded trial decayed every "
        "variable)"
    ]
    assert plan_differences(old, plan()) == []


@pytest.mark.parametrize(
    ("field", "difference"),
    [
        (
            "logits_thresholded_at_half",
            "the accuracy the model compiles scored on its logits as fit scores it, above 0.5 (the recorded trial "
            "counted a logit above 0)",
        ),
        (
            "validation_loss_terms",
            "the validation loss with the model's loss terms (its regularization, add_loss) as evaluate adds them "
            "(the recorded trial left them out)",
        ),
        (
            "compiled_clipping_cleared",
            "the spec's clipping none clears the clipping of the optimizer the build compiles (the recorded trial "
            "kept it)",
        ),
        (
            "validated_per_batch",
            "validated batch by batch as evaluate runs a model whose layers add loss terms or change its state as "
            "they are called (the recorded trial validated in chunks of many batches)",
        ),
        (
            "metric_rows",
            "the metrics given the labels' one-hot rows, as the loss is (the recorded trial gave them the labels)",
        ),
        (
            "compiled_accuracy",
            "the accuracy scored by the metric the model compiles under that name, as evaluate reports it (the "
            "recorded trial scored foldsweep's own)",
        ),
    ],
)
def test_what_fit_and_evaluate_do_is_recorded_and_a_plan_from_before_says_so(field, difference):
    as_evaluate = dataclasses.replace(plan(), **{field: True})
    recorded = as_evaluate.as_dict()
    del recorded[field]
    old = TrialPlan.from_dict(recorded)
    assert getattr(old, field) is False
    assert plan_differences(old, as_evaluate) == [difference]
    assert plan_differences(old, plan()) == []


def test_a_short_last_batch_is_padded_where_that_trains_its_own_samples_as_they_are():
    """``train.pad_last_batch`` pads each fold's short last batch to the batch size where
    XLA compiles a program per batch shape and the padding changes nothing but float rounding;
    a model whose layers see the whole batch keeps its last batch as it is."""
    import keras

    def model(*layers):
        return keras.Sequential([keras.Input((40, 1)), *layers, keras.layers.Flatten(), keras.layers.Dense(2)])

    def folds(*layers):
        return [model(*layers) for _ in range(3)]

    uneven = [301, 300, 300]
    padding = ExecutionChoices(jit_compile="on", layout="side_by_side", pad_last_batch=True)
    dropout = (keras.layers.Conv1D(4, 3), keras.layers.Dropout(0.2))
    padded = plan(padding, models=folds(*dropout), sizes=uneven)
    assert padded.last_batch_padded and padded.random_draws == "counter"
    assert plan(padding, models=folds(*dropout), sizes=[304, 304, 304]).last_batch_padded is False  # all full
    assert not plan(
        ExecutionChoices(jit_compile="on", layout="side_by_side"), models=folds(*dropout), sizes=uneven
    ).last_batch_padded
    off = ExecutionChoices(jit_compile="off", layout="side_by_side", pad_last_batch=True)
    assert not plan(off, models=folds(*dropout), sizes=uneven).last_batch_padded  # the graph runs any shape
    keras_numbers = ExecutionChoices(jit_compile="on", layout="side_by_side", pad_last_batch=True, random_draws="keras")
    assert not plan(keras_numbers, models=folds(*dropout), sizes=uneven).last_batch_padded
    assert plan(padding, models=folds(*dropout), sizes=uneven, keras_loss=False).last_batch_padded is False
    for whole_batch in (
        (keras.layers.Conv1D(4, 3), keras.layers.BatchNormalization()),
        (keras.layers.Conv1D(4, 3, activity_regularizer="l2"),),
    ):
        assert not plan(padding, models=folds(*whole_batch), sizes=uneven).last_batch_padded
    frozen = keras.layers.BatchNormalization()
    frozen.trainable = False  # inference: its statistics do not move
    assert plan(padding, models=[model(keras.layers.Conv1D(4, 3), frozen)] * 3, sizes=uneven).last_batch_padded

    # A plan recorded before padding replays unpadded, and says so against a padded one.
    recorded = padded.as_dict()
    del recorded["last_batch_padded"]
    old = TrialPlan.from_dict(recorded)
    assert not old.last_batch_padded
    assert not plan(replay_choices(old), models=folds(*dropout), sizes=uneven).last_batch_padded
    assert plan_differences(old, padded) == ["last batch padded off -> on"]


def test_the_graph_optimizer_asked_for_is_recorded_replayed_and_a_plan_from_before_ran_tensorflows_own():
    light = plan(ExecutionChoices(graph_optimizer="light"))
    assert light.graph_optimizer == "light" and plan().graph_optimizer == "full"
    recorded = light.as_dict()
    assert json.loads(json.dumps(recorded))["graph_optimizer"] == "light"
    assert plan(replay_choices(TrialPlan.from_dict(recorded))).graph_optimizer == "light"
    del recorded["graph_optimizer"]
    old = TrialPlan.from_dict(recorded)
    assert old.graph_optimizer == "full"
    assert plan_differences(old, light) == ["graph optimizer full -> light"]
    assert plan_differences(old, plan(replay_choices(old))) == []
