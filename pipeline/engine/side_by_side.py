"""Folds side by side: one execution trains every fold of a trial, each in its own loop.

The k fold models share an architecture and a batch size, and nothing else: each replica is the
researcher's ``build(hp)`` model, built once per fold, with its own weights, optimizer state (so
``global_clipnorm`` sees only its own gradients), random generator and health check. So one
compiled function runs all k folds' epochs, each the fold's own compiled loop over its own index
batches, and TensorFlow's executor runs the folds' independent steps concurrently, each fold loop
on an executor thread of its own (``pipeline.contract.plan.plan_threads`` sizes the pool). Each
fold's epoch is a traced function of its own that the execution calls
(``fold_engine.shared_epochs``: one traced epoch for every fold whose step is the first's), or,
where the trial keeps each fold's loop in the execution (a step inlined in the epoch, XLA with
the last batch left as it is or on a GPU), the loop itself. A fold whose update is not finite
leaves its own loop at that step, exactly where it would alone, and the others train on
untouched.

Side by side is one of the layouts ``pipeline.contract.plan`` chooses between: with one compute thread (or
on a GPU) the folds' weights are stacked into one XLA program instead (``pipeline.engine.stacked``),
which saves each fold's fixed cost per kernel but keeps to one core, while concurrent loops use
every core the trial has (`python -m benchmarks.cv_throughput --variants engine,side,stacked`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pipeline.engine.fold_engine import FoldEngine, TracedEpoch, close_shared_epoch, shared_epochs


class SideBySideFolds:
    """Trains fold engines one epoch at a time, all live folds in one execution, each in its own loop."""

    def __init__(self, engines: Sequence[FoldEngine]):
        self._engines = list(engines)
        # Each fold's epoch as a function of its own (``shared_epochs``), traced as the first
        # epoch begins; None where the execution holds the folds' loops themselves.
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
        tallies = [tally.numbers() for tally in self._execution(live)(batches)]
        return close_shared_epoch(self._engines, live, epoch, time.perf_counter() - started, tallies)

    def _execution(self, live: tuple[int, ...]) -> Any:
        """One compiled function training the ``live`` folds side by side: calling each one's
        traced epoch, or holding each one's loop."""
        import tensorflow as tf

        if live not in self._compiled:
            loops = [self._engines[i].epoch_loop if self.epochs is None else self.epochs[i] for i in live]
            self._compiled[live] = tf.function(
                lambda batches: [loop(*pair) for loop, pair in zip(loops, batches)], autograph=False
            )
        return self._compiled[live]
