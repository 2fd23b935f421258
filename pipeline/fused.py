"""Fold-fused training: one execution trains every fold of a trial, the folds side by side.

The k fold models share an architecture and a batch size, and nothing else: each replica is the
researcher's ``build(hp)`` model, built once per fold, with its own weights, optimizer state (so
``global_clipnorm`` sees only its own gradients), random generator and health check. So one
compiled function holds all k folds' epoch loops, each the fold's own compiled loop over its own
index batches, and TensorFlow's executor runs the folds' independent steps concurrently, each
fold loop on an executor thread of its own (``trial.thread_counts`` sizes the pool). A fold
whose update is not finite leaves its own loop at that step, exactly where it would alone, and
the others train on untouched.

Side by side is one of two layouts: with one compute thread (or on a GPU) the folds' weights
are stacked into one XLA program instead (``pipeline.stacked``, chosen by ``wants_stacking``),
which saves each fold's fixed cost per kernel but keeps to one core, while concurrent loops use
every core the trial has (`python -m benchmarks.cv_throughput --variants engine,side,stacked`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from pipeline.spec import AutoSwitch
from pipeline.training import EpochTally, FoldEngine


@dataclass(frozen=True)
class Fusion:
    """Whether a trial's folds train fused, and why, in one line for the record."""

    enabled: bool
    reason: str
    stacked: bool = False


def decide_fusion(choice: AutoSwitch, *, n_folds: int, eager: bool, shared_variables: int = 0,
                  check_numerics: bool = False) -> Fusion:
    """Fuse unless the spec says not to or the folds cannot run as independent replicas.

    Reasons that hold whatever the spec says come first: one fold has nothing to fuse with,
    eager debugging runs op by op, numeric checking must report the first non-finite value of
    a well-defined order, and fold models that share variables would update each other's
    weights while running side by side.
    """
    if n_folds < 2:
        return Fusion(False, "unfused: one fold to train")
    if eager:
        return Fusion(False, "unfused: eager execution (debugging) runs each fold op by op")
    if check_numerics:
        return Fusion(False, "unfused: numeric checking runs the folds one after another, so that the first "
                             "non-finite value is the same in every run")
    if shared_variables:
        return Fusion(False, f"unfused: the fold models share {shared_variables} variables (build(hp) "
                             "reuses layers between calls), so they cannot be trained as independent replicas")
    if choice == "off":
        return Fusion(False, "unfused: train.fused is false")
    if choice == "on":
        return Fusion(True, f"fused: {n_folds} folds in one execution (train.fused is true)")
    return Fusion(True, f"fused: {n_folds} folds in one execution")


FusedLayout = Literal["auto", "stacked", "side_by_side"]


# Stacked convolutions are products of patches, slower than the backend's convolutions once a
# batch has enough work: 3 folds with one compute thread, stacked against unfused (MNIST-1D /
# protein windows): batch 8 1.45x / 1.84x, 16 1.26x / 1.46x, 32 0.87x / 1.11x, 64 0.69x / 0.97x,
# 256 0.56x / 0.60x (`python -m benchmarks.cv_throughput --variants engine,fused --cpus 1`).
STACK_MAX_BATCH = 16


def wants_stacking(layout: FusedLayout, *, compute_threads: int, device: str, batch_size: int) -> bool:
    """Whether fused folds should be stacked (``pipeline.stacked``) rather than run side by side.

    Side by side, each fold loop needs a core of its own to gain: 3 folds with 2 compute threads
    trained 1.7-2.2x faster than one after another, stacked 1.4x (one XLA program runs on one
    core). With one compute thread the side-by-side loops only take turns, while stacking still
    saves each fold's fixed cost per kernel. On a GPU, stacking is what HFTA measured (one kernel
    launch for all folds); side-by-side loops would queue on one stream.
    """
    if layout != "auto":
        return layout == "stacked"
    return batch_size <= STACK_MAX_BATCH and ("GPU" in device or compute_threads < 2)


def arrange(fusion: Fusion, *, stacked: bool, compute_threads: int, batch_size: int,
            blocker: str | None = None) -> Fusion:
    """The fusion decision with its layout, in the one-line reason."""
    if not fusion.enabled:
        return fusion
    if stacked:
        return Fusion(True, f"{fusion.reason}, stacked into one XLA program per step", stacked=True)
    if blocker:
        why = f"not stacked: {blocker}"
    elif compute_threads >= 2 or batch_size <= STACK_MAX_BATCH:
        why = f"{compute_threads} compute thread{'s' if compute_threads != 1 else ''}"
    else:
        why = f"batch {batch_size}: stacking pays up to batch {STACK_MAX_BATCH}"
    return Fusion(True, f"{fusion.reason}, side by side ({why})")


def compute_threads() -> int:
    """The compute (intra-op) threads TensorFlow runs with in this process."""
    import tensorflow as tf

    return tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count() or 1


def side_by_side_loops(choice: AutoSwitch, *, n_folds: int, eager: bool = False, check_numerics: bool = False) -> int:
    """How many fold loops a trial may run at once, known before any model is built (to size
    TensorFlow's threads): its folds when they may be fused, else one."""
    may_fuse = decide_fusion(choice, n_folds=n_folds, eager=eager, check_numerics=check_numerics).enabled
    return n_folds if may_fuse else 1


def shared_variable_count(models: Sequence[Any]) -> int:
    """How many variables belong to more than one of these models."""
    owners: dict[int, int] = {}
    for model in models:
        for variable in {id(v): v for v in model.variables}:
            owners[variable] = owners.get(variable, 0) + 1
    return sum(1 for count in owners.values() if count > 1)


class FusedFolds:
    """Trains fold engines one epoch at a time, all live folds in one execution."""

    def __init__(self, engines: Sequence[FoldEngine]):
        self._engines = list(engines)
        # One compiled function per set of live folds: a fold that went NaN leaves the execution.
        self._compiled: dict[tuple[int, ...], Any] = {}

    def train_epoch(self, epoch: int, live: tuple[int, ...]) -> dict[int, float]:
        """Train the engines at positions ``live`` one epoch; returns their mean training loss."""
        import tensorflow as tf

        if live not in self._compiled:
            loops = [self._engines[i].epoch_loop for i in live]
            self._compiled[live] = tf.function(lambda batches: [loop(*pair) for loop, pair in zip(loops, batches)])
        batches = [self._engines[i].epoch_batch_tensors(epoch) for i in live]
        started = time.perf_counter()
        tallies = [EpochTally.of(outputs) for outputs in self._compiled[live](batches)]
        return close_fused_epoch(self._engines, live, epoch, time.perf_counter() - started, tallies)


def close_fused_epoch(engines: Sequence[FoldEngine], live: tuple[int, ...], epoch: int, seconds: float,
                      tallies: Sequence[EpochTally]) -> dict[int, float]:
    """Charge the live engines for an epoch trained together in ``seconds`` and close it with
    each one's tally; returns their mean training loss."""
    # The folds trained together: each is charged an equal share of the wall time, so that the
    # trial's rate (all samples over all fold seconds) is the rate the trial trained at.
    share = seconds / len(live)
    losses = {}
    for i, tally in zip(live, tallies):
        engine = engines[i]
        engine.train_timer.add(share, engine.train_samples)
        losses[i] = engine.close_epoch(epoch, tally)
    return losses
