"""What compiling a trial's training step costs and what each compiled form saves per step,
estimated before anything is traced, so that the plan (``pipeline.contract.plan``) can weigh one
against the other: a trial whose steps cannot win back XLA's compile, or an unrolled launch's,
gets the cheaper form, and the plan records what it estimated.

The size measure is the model's computing layers (leaf layers, nested models walked into): each
brings its forward, gradient and update ops, and tracing, TensorFlow's graph optimization and
XLA's compile all grow with the step's ops. What XLA saves is per layer too (the executor's cost
per op it fuses away); what unrolling saves is per launch and per layer (the launch's dispatch,
and fusion across the unrolled steps).

Every constant below is one linear fit (seconds = base + per layer x layers) over a residual 1D
CNN of 7, 19 and 67 layers (Conv1D, BatchNormalization, ReLU, Add; MNIST-1D, batch 8, 3 folds
side by side on 2 CPUs, the persistent compile cache off), re-measured with `python -m
benchmarks.compile_cost`: its compile seconds per form and its epoch seconds, from which the
savings per fold step (CPU time: the 3 folds shared 2 cores). Stacked folds save per fold step
what their one program saves against the graph's side-by-side loops on the one core they share,
a fit of its own by layers and by the multiply-adds of a batch (``multiply_adds``), for the vector
width of the graph's kernels on the host (``STACKED_SAVES_S``). Calibrated on CPU; a GPU's
compiles are estimated with the CPU's numbers, and its plan does not weigh them
(``pipeline.contract.plan``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.base.host_cpu import GraphVectorWidth
from pipeline.base.keras_private import flatten_layers

# The step's compiled forms: TensorFlow's graph (no XLA), one XLA program per step, one XLA
# program of several unrolled steps per launch, the folds stacked into one XLA program.
StepForm = Literal["graph", "xla", "unrolled", "stacked"]

# Compile seconds of a trial's training and validation steps: (base, per computing layer).
# Measured (compile_s, cache off) at 7 / 19 / 67 layers: graph 1.55 / 3.17 / 9.97, XLA 6.05 / 8.75 /
# 18.51, 8 unrolled steps 14.05 / 21.93 / 48.25, stacked (one CPU) 2.24 / 4.46 / 10.55.
COMPILE_S: dict[StepForm, tuple[float, float]] = {
    "graph": (0.53, 0.141),
    "xla": (4.70, 0.206),
    "unrolled": (10.60, 0.564),
    "stacked": (1.56, 0.135),
}
# CPU seconds per fold step per computing layer that XLA saves against the graph (the executor's
# per-op cost), fitted through zero: 0.39 / 1.08 / 4.63 s per epoch of 333 steps at 7 / 19 / 67
# layers, 3 folds on 2 cores.
XLA_SAVES_PER_LAYER_S = 0.136e-3
# CPU seconds per fold step that 8 unrolled steps per launch save against one: (base, per layer);
# 0.14 / 0.19 / 0.33 s per epoch at 7 / 19 / 67 layers.
UNROLLED_SAVES_S = (0.248e-3, 0.0062e-3)
# Wall seconds per fold step that stacked folds save against the graph's side-by-side loops on
# the one core they share: (per computing layer, less per multiply-add of the batch), by the
# vector width of the graph's kernels (``pipeline.base.host_cpu``). One program saves the
# executor's cost per op, which grows with the layers; its convolutions, products of patches,
# compute a multiply-add more slowly than the graph's oneDNN kernels do with AVX-512 (not than
# with AVX2: no credit either way). Fitted by `python -m benchmarks.compile_cost --blocks 1,4,16
# --filters 32,64 --batches 8,16 --variants stacked,noxla-1cpu` (``stacked_saving_fit``, priced at
# COMPILE_S) on an AMD EPYC with AVX-512, and with ONEDNN_MAX_CPU_ISA=AVX2 for "narrower". There it
# leaves out, at batch 16, the quickstart's net of 3 convolutions of 64 filters of width 5, which
# trained no faster stacked, and keeps its 32-filter nets and the deep residual ones
# (benchmarks/RESULTS.md, "2026-12-04 (evening)").
STACKED_SAVES_S: dict[GraphVectorWidth, tuple[float, float]] = {
    "avx512": (0.0115e-3, 0.0041e-9),
    "narrower": (0.0223e-3, 0.0),
}


def multiply_adds(model: Any) -> int:
    """Multiply-adds of one sample's forward pass through the model's convolutions and dense
    layers (nested models walked into). Normalisations, activations and pooling are elementwise, a
    few percent of a CNN's arithmetic, and are left out. Each layer's shapes are those it was built
    for, so a Sequential without an Input and a subclassed model count as a functional one; a
    length left unknown (``Input((None, channels))``) counts nothing, a layer shared between inputs
    counts once, and a wrapper's (``TimeDistributed``) repeats are not counted."""
    import keras

    layers = keras.layers
    transposed = (layers.Conv1DTranspose, layers.Conv2DTranspose, layers.Conv3DTranspose)
    depthwise = (layers.DepthwiseConv1D, layers.DepthwiseConv2D)
    separable = (layers.SeparableConv1D, layers.SeparableConv2D)
    convolutions = (layers.Conv1D, layers.Conv2D, layers.Conv3D)
    total = 0
    for layer in flatten_layers(model, include_self=False):
        if not isinstance(layer, (layers.Dense, *convolutions, *transposed, *depthwise, *separable)):
            continue
        shapes = _built_shapes(layer)
        if shapes is None:
            continue
        (in_positions, in_channels), (out_positions, _) = shapes
        if isinstance(layer, layers.Dense):
            total += in_positions * in_channels * layer.units
        elif isinstance(layer, transposed):  # each input position spreads over a kernel's outputs
            total += in_positions * in_channels * layer.filters * math.prod(layer.kernel_size)
        elif isinstance(layer, depthwise):
            total += out_positions * in_channels * layer.depth_multiplier * math.prod(layer.kernel_size)
        elif isinstance(layer, separable):  # a depthwise convolution, then a pointwise one
            channels = in_channels * layer.depth_multiplier
            total += out_positions * channels * (math.prod(layer.kernel_size) + layer.filters)
        else:
            total += out_positions * layer.filters * math.prod(layer.kernel_size) * (in_channels // layer.groups)
    return total


def _built_shapes(layer: Any) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(positions, channels) of the input a layer was built for and of its output; None for a
    layer not built, or built for shapes with unknown sizes."""
    try:
        built = layer.get_build_config()["input_shape"]
        shapes = (tuple(built), tuple(layer.compute_output_shape(built)))
    except Exception:  # not built, or built from several inputs
        return None
    channels_first = getattr(layer, "data_format", None) == "channels_first"
    sized = []
    for shape in shapes:
        inner = (shape[2:], shape[1]) if channels_first else (shape[1:-1], shape[-1])
        if not all(isinstance(size, int) for size in (*inner[0], inner[1])):
            return None
        sized.append((math.prod(inner[0]), inner[1]))
    return sized[0], sized[1]


def computing_layers(model: Any) -> int:
    """The model's leaf layers other than its inputs (nested models walked into)."""
    return sum(
        1
        for layer in flatten_layers(model, include_self=False)
        if type(layer).__name__ != "InputLayer" and not flatten_layers(layer, include_self=False, recursive=False)
    )


@dataclass(frozen=True)
class CompileCosts:
    """A model's estimated compile seconds per step form, and what XLA, unrolling and stacking
    save at its batch size: by its computing layers, and for stacking its multiply-adds per sample
    (``multiply_adds``) and the vector width of the graph's kernels it is weighed against."""

    layers: int
    batch_size: int
    multiply_adds: int = 0
    graph_vector_width: GraphVectorWidth = "narrower"

    def compile_s(self, form: StepForm) -> float:
        base, per_layer = COMPILE_S[form]
        return base + per_layer * self.layers

    def saved_s(self, form: StepForm, *, fold_steps: int) -> float:
        """CPU seconds ``form`` saves against the graph over ``fold_steps`` steps (all folds')."""
        if form == "graph":
            return 0.0
        if form == "stacked":
            per_layer, per_multiply_add = STACKED_SAVES_S[self.graph_vector_width]
            saved = per_layer * self.layers - per_multiply_add * self.multiply_adds * self.batch_size
            return max(0.0, saved) * fold_steps
        saved = XLA_SAVES_PER_LAYER_S * self.layers
        if form == "unrolled":
            base, per_layer = UNROLLED_SAVES_S
            saved += base + per_layer * self.layers
        return saved * fold_steps

    def pays(self, form: StepForm, over: StepForm, *, fold_steps: int, parallel: int) -> bool:
        """Whether ``form`` compiles and runs ``fold_steps`` steps (on ``parallel`` cores) in less
        wall time than ``over`` is estimated to."""
        extra = self.compile_s(form) - self.compile_s(over)
        saved = self.saved_s(form, fold_steps=fold_steps) - self.saved_s(over, fold_steps=fold_steps)
        return saved / max(1, parallel) >= extra
