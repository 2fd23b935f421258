"""Folds side by side: every fold of a trial trains at once, each in its own loop.

The k fold models share an architecture and a batch size, and nothing else: each replica is the
researcher's ``build(hp)`` model, built once per fold, with its own weights, optimizer state (so
``global_clipnorm`` sees only its own gradients), random generator and health check. Each fold's
epoch is its own compiled loop over its own index batches, and the folds' epochs run
concurrently: each fold's epoch a function of its own (``fold_engine.shared_epochs``: one traced
epoch for every fold whose step is the first's), called from a thread of its own, or, where the
trial keeps each fold's loop in one execution (a step inlined in the epoch, XLA), one compiled
function holding all k loops, each on an executor thread of its own. Either way the folds'
independent steps share the thread pools ``pipeline.contract.plan.plan_threads`` sizes. A fold
whose update is not finite leaves its own loop at that step, exactly where it would alone, and
the others train on untouched.

Side by side is one of the layouts ``pipeline.contract.plan`` chooses between: with one compute thread (or
on a GPU) the folds' weights are stacked into one XLA program instead (``pipeline.engine.stacked``),
which saves each fold's fixed cost per kernel but keeps to one core, while concurrent loops use
every core the trial has (`python -m benchmarks.cv_throughput --variants engine,side,stacked`).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from typing import Any

from pipeline.engine.fold_engine import FoldEngine, TracedEpoch, close_shared_epoch, shared_epochs


class SideBySideFolds:
    """Trains fold engines one epoch at a time, all live folds at once, each in its own loop."""

    def __init__(self, engines: Sequence[FoldEngine]):
        self._engines = list(engines)
        # Each fold's epoch as a function of its own (``shared_epochs``), traced as the first
        # epoch begins; None where the folds' loops train in one execution.
        self.epochs: list[TracedEpoch] | None = None
        self._traced = False
        # One compiled function per set of live folds: a fold that went NaN leaves the execution.
        self._compiled: dict[tuple[int, ...], Any] = {}

    def train_epoch(self, epoch: int, live: tuple[int, ...]) -> dict[int, float]:
        """Train the engines at positions ``live`` one epoch; returns their mean training loss."""
        batches = [self._engines[i].epoch_batch_tensors(epoch) for i in live]
        started = time.perf_counter()  # the folds' epochs are traced inside the first epoch's time
        if not self._traced:
            self.epochs, self._traced = shared_epochs(self._engines), True
        if self.epochs is not None:
            tallies = _concurrently([self.epochs[i] for i in live], batches)
        else:
            tallies = self._execution(live)(batches)
        numbers = [tally.numbers() for tally in tallies]
        return close_shared_epoch(self._engines, live, epoch, time.perf_counter() - started, numbers)

    def _execution(self, live: tuple[int, ...]) -> Any:
        """One compiled function training the ``live`` folds' loops side by side."""
        import tensorflow as tf

        if live not in self._compiled:
            loops = [self._engines[i].epoch_loop for i in live]
            self._compiled[live] = tf.function(
                lambda batches: [loop(*pair) for loop, pair in zip(loops, batches)], autograph=False
            )
        return self._compiled[live]


def _concurrently(epochs: Sequence[TracedEpoch], batches: Sequence[tuple[Any, Any]]) -> list[Any]:
    """Each fold's epoch run on its batches, all at once, each called from a thread of its own:
    TensorFlow runs a function's ops without Python, so the folds' executions overlap as the
    loops of one execution do."""
    with concurrent.futures.ThreadPoolExecutor(len(epochs)) as pool:
        running = [pool.submit(epoch, *pair) for epoch, pair in zip(epochs, batches)]
        return [run.result() for run in running]
