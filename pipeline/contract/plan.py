"""How a trial executes, decided once: XLA or not, steps per launch, the folds' layout and its
reason, whose random numbers the model's random layers draw, TensorFlow's thread pools, the
device, and on a GPU its own rules (when the host tests for a failed fold, how stacked folds
convolve, TF32, the GPU and determinism setting recorded). Every threshold of those decisions is
here, but for the compile estimates XLA and unrolling are weighed by (``pipeline.contract.compile_cost``).

Two moments: ``plan_threads`` before TensorFlow starts (thread pools cannot change afterwards),
``plan_trial`` once the fold models exist (XLA, unrolling and layout depend on the model). The
engines (``pipeline.engine.sequential``, ``pipeline.engine.side_by_side``, ``pipeline.engine.stacked``) only execute a
``TrialPlan``; the plan is recorded with the trial (tags and ``trial_plan.json``), so that a
rerun can execute exactly what the trial executed.

Nothing here imports TensorFlow or Keras: models are only looked at, never built.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pipeline.base.accelerator import GpuIdentity
from pipeline.base.errors import ExperimentError
from pipeline.base.host_cpu import GraphVectorWidth
from pipeline.base.keras_private import counter_drawn, flatten_layers, holds_seed_generator, seed_generator_of
from pipeline.contract.compile_cost import CompileCosts, StepForm, computing_layers, multiply_adds
from pipeline.inputs.spec import AutoSwitch, GraphOptimizer

# The folds' layouts: one after another, or fused (all in one execution): side by side, each in
# its own loop, or stacked into one XLA program (``pipeline.engine.<layout>`` executes each); a
# debugging command may force a fused one (``auto``: the plan decides).
FusedLayout = Literal["side_by_side", "stacked"]
Layout = Literal["sequential", FusedLayout]
ForcedLayout = Literal["auto", FusedLayout]
# Plans recorded before the layouts were named after their executors (after 31e017e) called one after
# another "unfused".
OLD_LAYOUTS: Mapping[str, Layout] = {"unfused": "sequential"}
# Whose random numbers a model's random layers draw in training: none (no random layer), Keras'
# own generator, or foldsweep's counter-based hash (pipeline.engine.draws), which XLA compiles
# into the step at the cost of an elementwise op and which stacks per fold.
RandomDraws = Literal["none", "keras", "counter"]
ForcedDraws = Literal["auto", "keras", "counter"]
# When the host reads a fold's tally to leave its epoch early: before every launch (a step that
# fails ends the epoch's loop; the sequential and side-by-side step applies its update under a
# tf.cond), or once, at the end of the epoch (every step's update is masked instead, so that a
# fold that failed keeps its weights, optimizer and layer state through the steps that follow).
StopTest = Literal["per_launch", "per_epoch"]
# How stacked folds convolve: each fold's kernel as one product of patches (CPU), or all folds'
# kernels as one grouped convolution (feature_group_count = k, the GPU's form).
StackedConvolutions = Literal["patches", "grouped"]

# A model with 2-D convolutions (these Keras classes and their subclasses) runs without XLA on
# CPU, at every batch size: XLA:CPU convolves images with its own kernels, where TensorFlow's
# graph calls oneDNN's, so its step is slower once compiled and its compile grows with the model
# (a keras.applications backbone compiles for minutes). Re-measure with `python -m
# benchmarks.trial_vs_fit --train jit_compile=true` against the same without it, and with
# `--batch-size 8`. On a GPU it compiles as every step does.
IMAGE_CONVOLUTIONS = ("Conv2D", "DepthwiseConv2D", "SeparableConv2D", "Conv2DTranspose")
# On CPU, XLA wins while per-step overhead dominates, at small batches, and loses once a step has
# work: its own convolution kernels are slower than the ones TensorFlow's graph calls (oneDNN),
# and each fold program compiles for seconds longer. Above this batch size the step runs without
# XLA on CPU; up to it, the plan weighs XLA's compile against its steps
# (``pipeline.contract.compile_cost``). Re-measure: `python -m benchmarks.cv_throughput --model
# mnist1d_cnn,protein_cnn --cpus 1 --variants fused-xla,fused-noxla --batch-sizes 8,16,32,64,256`
# (benchmarks/RESULTS.md, 2026-12-01). Random layers drawing from Keras' generator turn it
# around: its random-number ops under XLA on CPU made the MNIST-1D CNN's step 4-5x slower, so
# such a step runs without XLA on CPU. foldsweep's own draws (RandomDraws "counter") cost an
# elementwise op under XLA, so a model whose random layers it draws follows the batch-size rule
# (`python -m benchmarks.cv_throughput --model mnist1d_cnn,protein_cnn --cpus 1 --variants
# engine-xla,engine-noxla --baseline REV`, REV's engine-noxla drawing Keras' numbers).
XLA_MAX_BATCH_ON_CPU = 16

# Unrolling 8 steps into one XLA launch removes most of the per-launch cost left at small
# batches: samples/s with 1 / 8 steps per launch, 3 folds fused, 2-core CPU: batch 8, 36k / 83k
# (protein windows) and 34k / 52k (MNIST-1D); batch 64, 134k / 148k; at batch 256 unrolled was up
# to 21% slower unfused (`python -m benchmarks.cv_throughput --variants
# engine,fused,engine-x8,fused-x8`). Each unrolled step is compiled too, so auto mode unrolls up to
# batch 64 (on CPU where the step is XLA-compiled at all) and where the trial's planned steps win
# its compile back (``pipeline.contract.compile_cost``).
UNROLLED_STEPS = 8
UNROLL_MAX_BATCH = 64
# On a GPU, a launch costs the host its dispatch (the executor's loop iteration and XLA's launch:
# tens of microseconds) whatever the batch, and with the per-epoch stop test the host enqueues
# launches ahead of the device, so that this cost hides behind the device's work while a step
# takes longer than it, and shows while a step is shorter: at small batches (a small CNN's step
# at batch 8-128 is a few tens of microseconds of GPU time). So the GPU unrolls up to batch 128
# and from 5,000 planned steps per fold, about half what a small CNN's unrolled compile takes to
# win back on CPU (its compile costs about what the CPU's does; its steps are cheaper to win it
# back), and XLA compiles its every step, whatever the compile estimate. Chosen from that reasoning, not
# measured here (no GPU): `python -m benchmarks.gpu_check` measures 1, 8 and 32 steps per launch
# per batch size, to set these on the first GPU machine.
GPU_UNROLL_MAX_BATCH = 128
GPU_UNROLL_MIN_PLANNED_STEPS = 5_000

# Stacked convolutions are products of patches, slower than the backend's convolutions once a
# batch has enough work: 3 folds with one compute thread, stacked against unfused (MNIST-1D /
# protein windows): batch 8 1.45x / 1.84x, 16 1.26x / 1.46x, 32 0.87x / 1.11x, 64 0.69x / 0.97x,
# 256 0.56x / 0.60x (`python -m benchmarks.cv_throughput --variants engine,fused --cpus 1`).
# Measured on CPU, so a CPU rule only.
STACK_MAX_BATCH = 16
# On a GPU the folds stack at every batch size and their convolutions are grouped convolutions:
# the patch products above are the CPU's calibration (im2col copies every input tap), where a
# grouped convolution is one cuDNN kernel over all folds, what HFTA measured on GPUs (fusing the
# models of a sweep into grouped kernels trained them 2-15x faster than one model per process,
# gaining most at small batches and still gaining at large ones, where side-by-side loops only
# queue on the device's one stream). Not measured here (no GPU): `python -m benchmarks.gpu_check`
# measures stacked against side by side per batch size on the first GPU machine.
STACKED_CONVOLUTIONS_ON_GPU: StackedConvolutions = "grouped"
# Side by side, folds beyond a few per compute thread only take turns, while stacking saves each
# one's fixed cost per step: at batch 8 with 2 compute threads (MNIST-1D), side by side against
# stacked ran 1.22x at 6 folds, 1.02x at 9, 0.68x at 15 (repeated CV; `python -m
# benchmarks.replicas --batch-sizes 8 --replicas 6,9 --layouts side,stacked`).
SIDE_BY_SIDE_MAX_FOLDS_PER_THREAD = 4

# On a GPU the host must not wait for the device inside an epoch: a loop condition that reads the
# tally, or a tf.cond's predicate (XLA on GPU copies it to the host and waits for the stream), is
# a device-to-host copy and a sync per launch, which at small batches costs more than the step
# (a GPU step of a small CNN takes tens of microseconds; a sync drains the queue of launches the
# host had enqueued ahead). So the GPU plan masks each step's update and tests for a failed fold
# once per epoch: a fold that fails early in an epoch idles through the rest of it, masked. On CPU
# the host and the "device" are one, a wait costs nothing, and skipping the failed fold's steps
# is cheaper: the CPU keeps the per-launch test (and its numbers).
STOP_TEST_ON_GPU: StopTest = "per_epoch"


@dataclass(frozen=True)
class ExecutionChoices:
    """What the spec (or a debugging command) asks of execution; ``auto`` leaves it to the plan."""

    jit_compile: AutoSwitch = "auto"
    fused: AutoSwitch = "auto"
    steps_per_launch: int | Literal["auto"] = "auto"
    inline_step: bool = False
    pad_last_batch: bool = False
    graph_optimizer: GraphOptimizer = "full"
    layout: ForcedLayout = "auto"
    eager: bool = False
    check_numerics: bool = False
    random_draws: ForcedDraws = "auto"


@dataclass(frozen=True)
class ThreadPlan:
    """TensorFlow's (intra-op, inter-op) thread pools; 0 is TensorFlow's default."""

    intra_op: int
    inter_op: int

    def describe(self) -> str:
        def count(value: int) -> str:
            return str(value) if value else "default"

        return f"intra-op {count(self.intra_op)}, inter-op {count(self.inter_op)}"

    @property
    def compute_threads(self) -> int:
        return self.intra_op or os.cpu_count() or 1


@dataclass(frozen=True)
class TrialPlan:
    """How one trial executes; frozen, recorded, and the engines' only instructions."""

    jit_compile: bool
    steps_per_launch: int
    layout: Layout
    reason: str
    threads: ThreadPlan
    device: str
    # Plans recorded before foldsweep drew random numbers itself had random layers draw Keras'.
    random_draws: RandomDraws = "keras"
    # Whether an uncompiled training step is inlined at each of the epoch's calls, rather than
    # called as a function TensorFlow's graph optimizer works through once (the float rounding of
    # its kernels differs); plans recorded before were inlined. An XLA-compiled step is lowered once.
    step_inlined: bool = True
    # Plans recorded before the GPU rules tested for a failed fold before every launch, convolved
    # stacked folds as patch products and did not record TF32.
    stop_test: StopTest = "per_launch"
    stacked_convolutions: StackedConvolutions = "patches"
    # Whether the GPU's matrix products and convolutions may round their inputs to TensorFlow's
    # TF32 (on by default, effective on Ampere and newer): a trajectory another than in float32,
    # and the stacked forward check's tolerance (``pipeline.engine.stacked``). False on CPU.
    tf32: bool = False
    # The GPU the trial computed on, with its driver, CUDA and cuDNN (None on CPU, or where it
    # could not be identified), and whether TensorFlow's ops ran deterministically.
    gpu: GpuIdentity | None = None
    deterministic_ops: bool = False
    # The training and validation steps' compile seconds, estimated from the model's size
    # (``pipeline.contract.compile_cost``) before anything was traced; None in plans recorded before.
    compile_estimate_s: float | None = None
    # Whether each fold's short last batch of an epoch ran padded to the batch size, its padding
    # masked out of the loss, the tally and the gradient (``train.pad_last_batch``): XLA compiles
    # one program per batch size instead of one more per distinct last batch. The same samples
    # and numbers but for float rounding; plans recorded before ran it as it is.
    last_batch_padded: bool = False
    # The optimizer's ``loss_scale_factor``, which the step cancels as fit does: fit scales the
    # loss by it and the optimizer divides the gradients by it, which in float32 (all foldsweep
    # trains in) leaves the update as it is, so the step leaves out both. None without one, and in
    # plans recorded before, whose step divided the gradients by it without scaling the loss.
    loss_scale_factor: float | None = None
    # Whether the optimizer leaves variables out of weight decay (its exclude_from_weight_decay),
    # as each fold's optimizer does; plans recorded before decayed every variable.
    decay_exclusions: bool = False
    # How TensorFlow's graph optimizer worked through the trial's traced functions
    # (``train.graph_optimizer``); plans recorded before ran it as TensorFlow does by default.
    graph_optimizer: GraphOptimizer = "full"
    # Whether a one-unit head read as logits is scored by the "accuracy" its model compiles as fit
    # scores it, an output above 0.5 counting as class 1 (``TrainingLoss.logits_thresholded_at_half``);
    # plans recorded before counted a logit above 0.
    logits_thresholded_at_half: bool = False
    # Whether the validation loss adds the model's loss terms (``model.losses``: its weights'
    # regularization, its layers' activity regularization and ``add_loss``) to each batch's, as
    # evaluate does; plans recorded before left them out.
    validation_loss_terms: bool = False
    # Whether each fold is validated in batches of the trial's size, one after another, as
    # evaluate runs them, for a model whose layers add loss terms or change its state as they are
    # called; plans recorded before validated every model in chunks of many batches.
    validated_per_batch: bool = False
    # Whether the accuracy is a metric the model compiles under that name, as evaluate reports
    # it; plans recorded before scored foldsweep's own in its place.
    compiled_accuracy: bool = False
    # Whether the spec's clipping ``none`` cleared the clipping of the optimizer the build compiled
    # (the spec's clipping, where it names one, is the optimizer's whole clipping); plans recorded
    # before kept the compiled clipping under ``none``.
    compiled_clipping_cleared: bool = False
    # Whether the model's metrics got one-hot rows of integer labels, as its loss did (a loss that
    # takes rows: fit gives both to_categorical(y)); plans recorded before gave them the labels.
    metric_rows: bool = False

    @property
    def fused(self) -> bool:
        """Whether the folds train in one execution (side by side or stacked): ``train.fused``'s
        word, recorded as the tag ``foldsweep.fused``."""
        return self.layout != "sequential"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrialPlan:
        gpu = values.get("gpu")
        return cls(
            **{
                **values,
                "layout": OLD_LAYOUTS.get(values["layout"], values["layout"]),
                "threads": ThreadPlan(**values["threads"]),
                "gpu": GpuIdentity(**gpu) if gpu else None,
            }
        )


def plan_threads(choices: ExecutionChoices, *, cpus: float, n_folds: int) -> ThreadPlan:
    """The thread pools of a trial of ``cpus`` CPUs over ``n_folds`` folds, known before any
    model is built (TensorFlow cannot change them once started)."""
    # Intra-op threads split big ops: one per CPU of the trial. Inter-op threads run the graph,
    # and an XLA launch holds one while it computes, so a fold loop trains fastest on a thread
    # of its own: an unfused trial at batch 8 ran 1.1-1.4x faster with 1 inter-op thread than
    # with 2 (work hopping between threads), and 3 fused folds ran 1.2x (MNIST-1D) to 2x
    # (protein) faster on 3 than on 2 (a fold waited for a thread while a core idled).
    # With one CPU the folds stack or take turns on one thread rather than compute on several.
    compute = max(1, int(cpus))
    may_fuse = _unfused_reason(choices, n_folds=n_folds) is None and choices.layout != "stacked"
    loops = n_folds if may_fuse else 1
    return ThreadPlan(intra_op=compute, inter_op=loops if compute >= 2 else 1)


def plan_trial(
    choices: ExecutionChoices,
    *,
    models: Sequence[Any],
    threads: ThreadPlan,
    device: str,
    batch_size: int,
    train_sizes: Sequence[int],
    planned_epochs: int,
    stacking_blocker: Callable[[bool, RandomDraws, StackedConvolutions], str | None],
    xla_blocker: Callable[[RandomDraws], str | None] = lambda random_draws: None,
    tf32: bool = False,
    gpu: GpuIdentity | None = None,
    deterministic_ops: bool = False,
    keras_loss: bool = True,
    loss_scale_factor: float | None = None,
    decay_exclusions: bool = False,
    logits_thresholded_at_half: bool = False,
    validation_loss_terms: bool = False,
    validated_per_batch: bool = False,
    compiled_accuracy: bool = False,
    compiled_clipping_cleared: bool = False,
    metric_rows: bool = False,
    graph_vector_width: GraphVectorWidth = "narrower",
) -> TrialPlan:
    """The whole plan of a trial whose fold models are built.

    Args:
        models: one built model per fold (looked at, not run).
        threads: the thread pools TensorFlow runs with in this process.
        train_sizes: each fold's training samples.
        stacking_blocker: why these models cannot train stacked with or without XLA, with the
            random draws and the stacked convolutions given as its arguments, or None; asked only
            when stacking is wanted (it runs the models).
        xla_blocker: why XLA cannot compile these models' step (an op it has no kernel for), or
            None, with the random draws given (foldsweep's replace ops XLA has no kernel for);
            asked only when XLA is wanted (it traces a model).
        tf32: whether TensorFlow may compute in TF32 on ``device`` (a GPU's, as its process has it).
        gpu: the GPU of ``device`` identified (``pipeline.base.accelerator``), recorded.
        deterministic_ops: whether TensorFlow runs its ops deterministically here, recorded.
        keras_loss: whether the trial's loss is one of Keras' own, which sees each sample alone
            (``padding_blocker``).
        loss_scale_factor, decay_exclusions, compiled_clipping_cleared: the optimizer's, recorded
            (``TrialPlan``'s).
        logits_thresholded_at_half, validation_loss_terms, validated_per_batch, compiled_accuracy,
            metric_rows: how the trial's validation is scored (``TrialPlan``'s), recorded.
        graph_vector_width: the vector width of the graph's kernels in this process
            (``pipeline.base.host_cpu``), against which stacked folds are weighed on CPU.
    """
    random_draws = model_random_draws(choices.random_draws, models[0])
    on_gpu = _device_kind(device) == "GPU"
    # Stacked folds and unrolled launches: forms only XLA executes.
    xla_form_forced = choices.layout == "stacked" or choices.steps_per_launch not in ("auto", 1)
    jit_compile = _use_xla(
        choices.jit_compile,
        batch_size=batch_size,
        device=device,
        stochastic=random_draws == "keras",
        convolves_images=convolves_images(models[0]),
        xla_form_forced=xla_form_forced,
    )
    without_xla = xla_blocker(random_draws) if jit_compile else None
    if without_xla is not None:
        if choices.jit_compile == "on":
            raise ExperimentError(forced_xla_refusal("this trial's model", without_xla))
        jit_compile = False
    planned_steps = planned_epochs * min(train_sizes) // batch_size
    costs = CompileCosts(computing_layers(models[0]), batch_size, multiply_adds(models[0]), graph_vector_width)
    # XLA is weighed where nothing asks for it: not forced, nor a layout or a form only XLA
    # executes, nor on a GPU (whose compiles are not calibrated).
    weighed = (
        jit_compile
        and choices.jit_compile == "auto"
        and choices.layout == "auto"
        and not xla_form_forced
        and not on_gpu
        and not choices.eager
    )

    def too_short_for(form: StepForm, parallel: int) -> str | None:
        """Why XLA's compile in ``form`` would cost more than it saves in this trial, or None."""
        if costs.pays(form, over="graph", fold_steps=planned_steps * len(models), parallel=parallel):
            return None
        return (
            f"its compile (~{costs.compile_s(form):.0f} s estimated for {costs.layers} layers, "
            f"~{costs.compile_s('graph'):.0f} s without) would cost more than "
            f"{_stacked_saving_phrase(graph_vector_width) if form == 'stacked' else 'XLA saves'} in "
            f"{planned_steps} steps per fold"
        )

    unfused = _unfused_reason(choices, n_folds=len(models), shared_variables=shared_variable_count(models))
    # The cores unstacked folds share: one after another, one; side by side, a loop per thread.
    loop_cores = 1 if unfused is not None else min(threads.compute_threads, len(models))
    stack = unfused is None and _wants_stacking(
        choices.layout,
        compute_threads=threads.compute_threads,
        device=device,
        batch_size=batch_size,
        n_folds=len(models),
    )
    if weighed:
        without_xla = too_short_for("stacked" if stack else "xla", 1 if stack else loop_cores)
        jit_compile = without_xla is None
    convolutions: StackedConvolutions = STACKED_CONVOLUTIONS_ON_GPU if on_gpu else "patches"
    layout: Layout
    if unfused is not None:
        layout, reason = "sequential", unfused
    else:
        fused = f"fused: {len(models)} folds in one execution" + (
            " (train.fused is true)" if choices.fused == "on" else ""
        )
        blocker = stacking_blocker(jit_compile, random_draws, convolutions) if stack else None
        if stack and blocker is None:
            layout, reason = "stacked", f"{fused}, stacked into one XLA program per step"
        else:
            layout = "side_by_side"
            if weighed and jit_compile and stack:  # weighed stacked, which the blocker refused
                without_xla = too_short_for("xla", loop_cores)
                jit_compile = without_xla is None
            why = _side_by_side_why(threads.compute_threads, batch_size, blocker, n_folds=len(models))
            reason = f"{fused}, side by side ({why})"
    steps = _steps_per_launch(
        choices.steps_per_launch,
        jit_compile=jit_compile and not choices.eager,
        batch_size=batch_size,
        device=device,
        unrolling_pays=(
            planned_steps >= GPU_UNROLL_MIN_PLANNED_STEPS
            if on_gpu
            else costs.pays(
                "unrolled",
                over="xla",
                fold_steps=planned_steps * len(models),
                parallel=1 if layout == "stacked" else loop_cores,
            )
        ),
    )
    if without_xla is not None:
        reason = f"{reason}; without XLA: {without_xla}"
    return TrialPlan(
        jit_compile=jit_compile,
        steps_per_launch=steps,
        layout=layout,
        reason=reason,
        threads=threads,
        device=device,
        random_draws=random_draws,
        step_inlined=choices.inline_step and not jit_compile,
        stop_test=_stop_test(choices, device=device),
        stacked_convolutions=convolutions,
        tf32=tf32 and on_gpu,
        gpu=gpu if on_gpu else None,
        deterministic_ops=deterministic_ops,
        compile_estimate_s=round(costs.compile_s(_step_form(jit_compile and not choices.eager, steps, layout)), 1),
        last_batch_padded=(
            choices.pad_last_batch
            and jit_compile
            and not choices.eager
            and layout != "stacked"
            and any(size % batch_size for size in train_sizes)
            and padding_blocker(models[0], random_draws, keras_loss=keras_loss) is None
        ),
        loss_scale_factor=loss_scale_factor,
        decay_exclusions=decay_exclusions,
        graph_optimizer=choices.graph_optimizer,
        logits_thresholded_at_half=logits_thresholded_at_half,
        validation_loss_terms=validation_loss_terms,
        validated_per_batch=validated_per_batch,
        compiled_accuracy=compiled_accuracy,
        compiled_clipping_cleared=compiled_clipping_cleared,
        metric_rows=metric_rows,
    )


def _stacked_saving_phrase(graph_vector_width: GraphVectorWidth) -> str:
    if graph_vector_width == "avx512":
        return "its stacked folds save against the graph's AVX-512 kernels"
    return "its stacked folds save"


def padding_blocker(model: Any, random_draws: RandomDraws, *, keras_loss: bool = True) -> str | None:
    """Why padding a short last batch with samples whose loss is masked out would train ``model``
    otherwise than its batch as it is, beyond float rounding; None where it would not. A padded
    sample adds nothing to the loss or the gradient, and a layer that computes each sample on its
    own gives the batch's samples the same outputs; but a layer in training whose state moves with
    the whole batch (a BatchNormalization's statistics), an activity regularizer (its penalty adds
    up every sample), or Keras' random generator (its numbers depend on the shape drawn) would
    see the padding. foldsweep's own random numbers are hashed per element from the front of the
    batch, so its samples draw the same numbers padded or not (``pipeline.engine.draws``)."""
    if random_draws == "keras":
        return "its random layers draw Keras' numbers, which depend on the batch's shape"
    if not keras_loss:
        return "its loss is not one of Keras' (``TrainingLoss.keras_own``), and may look at the whole batch"
    for layer in flatten_layers(model, include_self=False):
        if getattr(layer, "activity_regularizer", None) is not None:
            return f"layer {layer.name!r} has an activity regularizer, which adds up every sample of the batch"
        if not layer.trainable or flatten_layers(layer, include_self=False, recursive=False):
            continue  # a frozen layer runs in inference; a nested model's layers are its own leaves
        generator = seed_generator_of(layer)
        drawn = {id(generator.state)} if generator is not None else set()
        if any(id(variable) not in drawn for variable in layer.non_trainable_variables):
            return f"layer {layer.name!r} ({type(layer).__name__}) keeps state that moves with the whole batch"
    return None


def _step_form(jit_compile: bool, steps_per_launch: int, layout: Layout) -> StepForm:
    if not jit_compile:
        return "graph"
    if layout == "stacked":
        return "stacked"
    return "unrolled" if steps_per_launch > 1 else "xla"


def forced_xla_refusal(model: str, blocker: str) -> str:
    """What refuses ``train.jit_compile: true`` for ``model`` (named), which XLA cannot compile."""
    return (
        f"train.jit_compile is true, but in {model} {blocker}: set it to auto (foldsweep then trains this model "
        "without XLA) or false"
    )


def replay_choices(recorded: TrialPlan, *, eager: bool = False, check_numerics: bool = False) -> ExecutionChoices:
    """The choices that make ``plan_trial`` decide again what a recorded plan decided, as far as
    the debugging options allow (eager and numeric checking run without XLA, sequential; the random
    numbers stay the recorded ones)."""
    return ExecutionChoices(
        jit_compile="off" if eager or check_numerics else ("on" if recorded.jit_compile else "off"),
        fused="on" if recorded.fused else "off",
        steps_per_launch=recorded.steps_per_launch,
        inline_step=recorded.step_inlined,
        pad_last_batch=recorded.last_batch_padded,
        graph_optimizer=recorded.graph_optimizer,
        layout="auto" if recorded.layout == "sequential" else recorded.layout,
        eager=eager,
        check_numerics=check_numerics,
        random_draws="auto" if recorded.random_draws == "none" else recorded.random_draws,
    )


# What a rerun says where its plan and the recorded one part on how the trial is scored and its
# optimizer made (``TrialPlan``'s fields of the same names): (now on, now off).
SCORING_CHANGES: Mapping[str, tuple[str, str]] = {
    "logits_thresholded_at_half": (
        "the accuracy the model compiles scored on its logits as fit scores it, above 0.5 (the recorded trial "
        "counted a logit above 0)",
        "the accuracy of logits counted above 0 (the recorded trial counted them above 0.5)",
    ),
    "compiled_clipping_cleared": (
        "the spec's clipping none clears the clipping of the optimizer the build compiles (the recorded trial kept it)",
        "the clipping of the optimizer the build compiles kept (the recorded trial cleared it)",
    ),
    "validation_loss_terms": (
        "the validation loss with the model's loss terms (its regularization, add_loss) as evaluate adds them "
        "(the recorded trial left them out)",
        "the validation loss without the model's loss terms (the recorded trial added them)",
    ),
    "validated_per_batch": (
        "validated batch by batch as evaluate runs a model whose layers add loss terms or change its state as "
        "they are called (the recorded trial validated in chunks of many batches)",
        "validated in chunks of many batches (the recorded trial batch by batch)",
    ),
    "compiled_accuracy": (
        "the accuracy scored by the metric the model compiles under that name, as evaluate reports it (the "
        "recorded trial scored foldsweep's own)",
        "the accuracy scored by foldsweep (the recorded trial by a metric the model compiles under that name)",
    ),
    "metric_rows": (
        "the metrics given the labels' one-hot rows, as the loss is (the recorded trial gave them the labels)",
        "the metrics given the labels (the recorded trial gave them one-hot rows)",
    ),
}


def plan_differences(recorded: TrialPlan, now: TrialPlan) -> list[str]:
    """What of ``now`` may make a trial walk another trajectory than ``recorded`` did.

    One fold alone or side by side with others runs the same compiled steps on the same thread
    pools, so sequential against side by side is no difference; stacked folds are one XLA program
    whose float rounding differs from a fold's own.
    """
    differences = []
    if now.jit_compile != recorded.jit_compile:
        differences.append(f"jit_compile {recorded.jit_compile} -> {now.jit_compile}")
    if now.last_batch_padded != recorded.last_batch_padded:
        differences.append(
            f"last batch padded {_on_off(recorded.last_batch_padded)} -> {_on_off(now.last_batch_padded)}"
        )
    if now.graph_optimizer != recorded.graph_optimizer:
        differences.append(f"graph optimizer {recorded.graph_optimizer} -> {now.graph_optimizer}")
    if not now.jit_compile and not recorded.jit_compile and now.step_inlined != recorded.step_inlined:
        differences.append(f"step inlined {_on_off(recorded.step_inlined)} -> {_on_off(now.step_inlined)}")
    if now.steps_per_launch != recorded.steps_per_launch:
        differences.append(f"steps per launch {recorded.steps_per_launch} -> {now.steps_per_launch}")
    if now.layout != recorded.layout and "stacked" in (now.layout, recorded.layout):
        differences.append(f"layout {recorded.layout} -> {now.layout}")
    if now.threads != recorded.threads:
        differences.append(f"threads {recorded.threads.describe()} -> {now.threads.describe()}")
    if _device_kind(now.device) != _device_kind(recorded.device):
        differences.append(f"device {recorded.device} -> {now.device}")
    if now.random_draws != recorded.random_draws and "counter" in (now.random_draws, recorded.random_draws):
        differences.append(f"random draws {recorded.random_draws} -> {now.random_draws}")
    if now.layout == recorded.layout == "stacked" and now.stacked_convolutions != recorded.stacked_convolutions:
        differences.append(f"stacked convolutions {recorded.stacked_convolutions} -> {now.stacked_convolutions}")
    if now.tf32 != recorded.tf32:
        differences.append(f"TF32 {_on_off(recorded.tf32)} -> {_on_off(now.tf32)}")
    if recorded.gpu is not None and now.gpu is not None:
        differences.extend(recorded.gpu.differences(now.gpu))
    if now.loss_scale_factor != recorded.loss_scale_factor:
        differences.append(
            f"the optimizer's loss_scale_factor {now.loss_scale_factor} cancelled as fit does (the recorded trial "
            "divided its gradients by it)"
            if recorded.loss_scale_factor is None
            else f"loss_scale_factor {recorded.loss_scale_factor} -> {now.loss_scale_factor}"
        )
    if now.decay_exclusions != recorded.decay_exclusions:
        differences.append(
            "the optimizer's variables left out of weight decay as fit leaves them (the recorded trial decayed every "
            "variable)"
            if now.decay_exclusions
            else "variables left out of weight decay on -> off"
        )
    for field, (turned_on, turned_off) in SCORING_CHANGES.items():
        if getattr(now, field) != getattr(recorded, field):
            differences.append(turned_on if getattr(now, field) else turned_off)
    if now.deterministic_ops != recorded.deterministic_ops:
        differences.append(
            f"deterministic ops {_on_off(recorded.deterministic_ops)} -> {_on_off(now.deterministic_ops)}"
        )
    return differences


def _on_off(value: bool) -> str:
    return "on" if value else "off"


def _device_kind(device: str) -> str:
    return "GPU" if "GPU" in device else "CPU"


def _stop_test(choices: ExecutionChoices, *, device: str) -> StopTest:
    """Once per epoch on a GPU (``STOP_TEST_ON_GPU``), else before every launch; eager debugging and
    numeric checking run op by op, where a wait is no cost and stopping at once is the point."""
    if _device_kind(device) == "GPU" and not choices.eager and not choices.check_numerics:
        return STOP_TEST_ON_GPU
    return "per_launch"


def model_random_draws(choice: ForcedDraws, model: Any) -> RandomDraws:
    """foldsweep's own draws wherever it can draw for every random layer of the model (or where
    a recorded plan had them), unless Keras' generator is asked for (a plan recorded before)."""
    random_layers = [layer for layer in flatten_layers(model) if holds_seed_generator(layer)]
    if not random_layers:
        return "none"
    if choice == "keras" or not all(counter_drawn(layer) for layer in random_layers):
        return "keras"
    return "counter"


def _use_xla(
    choice: AutoSwitch,
    *,
    batch_size: int,
    device: str,
    stochastic: bool,
    convolves_images: bool,
    xla_form_forced: bool = False,
) -> bool:
    """Forced by the spec, else by device, batch size (unless a form only XLA executes is forced:
    stacked folds, unrolled launches), whether the model draws Keras' random numbers in training
    and whether it convolves images."""
    if choice != "auto":
        return choice == "on"
    if "GPU" in device:
        return True
    return (batch_size <= XLA_MAX_BATCH_ON_CPU or xla_form_forced) and not stochastic and not convolves_images


def convolves_images(model: Any) -> bool:
    """Whether a model (nested models included) has a layer of the ``IMAGE_CONVOLUTIONS`` classes."""
    return any(
        cls.__name__ in IMAGE_CONVOLUTIONS and cls.__module__.startswith("keras.")
        for layer in flatten_layers(model)
        for cls in type(layer).__mro__
    )


def _steps_per_launch(
    choice: int | Literal["auto"], *, jit_compile: bool, batch_size: int, device: str, unrolling_pays: bool
) -> int:
    """The spec's number, else unrolled up to the device's batch size where the planned steps win
    the unrolled compile back; one without XLA (nothing to unroll)."""
    if not jit_compile:
        return 1
    if choice != "auto":
        return int(choice)
    max_batch = GPU_UNROLL_MAX_BATCH if _device_kind(device) == "GPU" else UNROLL_MAX_BATCH
    if batch_size > max_batch or not unrolling_pays:
        return 1
    return UNROLLED_STEPS


def _unfused_reason(choices: ExecutionChoices, *, n_folds: int, shared_variables: int = 0) -> str | None:
    """Why the folds train one after another, or None when they may be fused.

    Reasons that hold whatever the spec says come first: one fold has nothing to fuse with,
    eager debugging runs op by op, numeric checking must report the first non-finite value of
    a well-defined order, and fold models that share variables would update each other's
    weights while running side by side.
    """
    if n_folds < 2:
        return "unfused: one fold to train"
    if choices.eager:
        return "unfused: eager execution (debugging) runs each fold op by op"
    if choices.check_numerics:
        return (
            "unfused: numeric checking runs the folds one after another, so that the first "
            "non-finite value is the same in every run"
        )
    if shared_variables:
        return (
            f"unfused: the fold models share {shared_variables} variables (build(hp) reuses frozen layers between "
            "calls), so they cannot be trained as independent replicas"
        )
    if choices.fused == "off":
        return "unfused: train.fused is false"
    return None


def _wants_stacking(layout: ForcedLayout, *, compute_threads: int, device: str, batch_size: int, n_folds: int) -> bool:
    """Whether fused folds should be stacked rather than run side by side.

    Side by side, each fold loop needs a core of its own to gain: 3 folds with 2 compute threads
    trained 1.7-2.2x faster than one after another, stacked 1.4x (one XLA program runs on one
    core). With one compute thread, or many more folds than threads (repeated CV), the
    side-by-side loops only take turns, while stacking still saves each fold's fixed cost per
    kernel. On a GPU, stacking is what HFTA measured (one kernel launch for all folds);
    side-by-side loops would queue on one stream.
    """
    if layout != "auto":
        return layout == "stacked"
    if _device_kind(device) == "GPU":  # at every batch size (STACKED_CONVOLUTIONS_ON_GPU)
        return True
    return batch_size <= STACK_MAX_BATCH and _loops_take_turns(compute_threads, n_folds)


def _loops_take_turns(compute_threads: int, n_folds: int) -> bool:
    return compute_threads < 2 or n_folds > SIDE_BY_SIDE_MAX_FOLDS_PER_THREAD * compute_threads


def _side_by_side_why(compute_threads: int, batch_size: int, blocker: str | None, *, n_folds: int) -> str:
    if blocker:
        return f"not stacked: {blocker}"
    if batch_size > STACK_MAX_BATCH and _loops_take_turns(compute_threads, n_folds):
        return f"batch {batch_size}: stacking pays up to batch {STACK_MAX_BATCH}"
    return f"{compute_threads} compute thread{'s' if compute_threads != 1 else ''}"


def shared_variable_count(models: Sequence[Any], *, trainable: bool = False) -> int:
    """How many variables (``trainable`` ones only, if so) belong to more than one of these models."""
    owners: dict[int, int] = {}
    for model in models:
        for variable in {id(v): v for v in (model.trainable_variables if trainable else model.variables)}:
            owners[variable] = owners.get(variable, 0) + 1
    return sum(1 for count in owners.values() if count > 1)
