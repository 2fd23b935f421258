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
a fit of its own by batch size (``STACKED_SAVES_S``). Calibrated on CPU; a GPU's compiles are
estimated with the CPU's numbers, and its plan does not weigh them (``pipeline.contract.plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

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
# the one core they share, by batch size: (base, less per sample of the batch). Not per layer:
# what one program saves of the executor's cost per op, its convolutions' patch products give
# back as the batch and the model grow. Measured with `python -m benchmarks.compile_cost --batches
# 4,8,16 --variants stacked,noxla-1cpu` (7 / 19 / 67 layers) on a machine slower than the fits
# above, each saving taken in proportion to its own run's extra compile of the stacked form,
# which COMPILE_S prices; fitted over those 15 pairs and 3 of the quickstart's 10-layer net at
# batch 16: 0.42e-3 at batch 4, 0.35e-3 at 8, 0.21e-3 at 16, nothing from batch 28 (stacking
# stops at ``plan.STACK_MAX_BATCH`` before that). The benchmark prints this fit from its rows. It
# is the fitted machine's: where the graph's convolutions (oneDNN) compute with AVX-512, they run
# faster against the stacked program's, and the quickstart's net gains nothing stacked at batch 16
# (benchmarks/RESULTS.md, "2026-12-04 (afternoon)").
STACKED_SAVES_S = (0.49e-3, 0.0178e-3)


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
    save at its batch size."""

    layers: int
    batch_size: int

    def compile_s(self, form: StepForm) -> float:
        base, per_layer = COMPILE_S[form]
        return base + per_layer * self.layers

    def saved_s(self, form: StepForm, *, fold_steps: int) -> float:
        """CPU seconds ``form`` saves against the graph over ``fold_steps`` steps (all folds')."""
        if form == "graph":
            return 0.0
        if form == "stacked":
            base, per_sample = STACKED_SAVES_S
            return max(0.0, base - per_sample * self.batch_size) * fold_steps
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
