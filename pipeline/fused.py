"""Fold-fused training: the steps of a trial's k fold models compiled into one step.

The k fold models share an architecture and a batch size, so one compiled step can train them
all: each fold gathers its own index batch from the device-resident data and runs its own
forward pass, gradient, clipping and optimizer update. Nothing is shared between folds but the
step they run in: each replica is the researcher's ``build(hp)`` model, built once per fold, with
its own weights, optimizer state (so ``global_clipnorm`` sees only its own gradients), random
generator and health check. A fold whose update is not finite is switched off inside the step
and the others train on, exactly as they would without it.

Per batch, the fused step replaces k executions of the loop body with one, and in the compiled
program the folds' independent operations can be scheduled and fused together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from pipeline.spec import AutoSwitch
from pipeline.training import EpochTally, FoldEngine

# On the 2-core CPU, fused steps were measured faster than separate fold loops up to batch 128
# (1.1-1.5x, with and without XLA) and up to 18% slower at 256 for the MNIST-1D CNN
# (`python -m benchmarks.cv_throughput --variants engine,fused [--dropout]`); above this batch
# size auto mode trains the folds separately on CPU.
FUSED_MAX_BATCH_ON_CPU = 128


@dataclass(frozen=True)
class Fusion:
    """Whether a trial's folds train fused, and why, in one line for the record."""

    enabled: bool
    reason: str


def decide_fusion(choice: AutoSwitch, *, n_folds: int, batch_size: int, device: str, eager: bool,
                  shared_variables: int = 0) -> Fusion:
    """Fuse when the spec says so, else when the folds can be replicated and it is faster.

    Reasons that hold whatever the spec says come first: one fold has nothing to fuse with,
    eager debugging runs op by op, and fold models that share variables are not independent
    replicas.
    """
    if n_folds < 2:
        return Fusion(False, "unfused: one fold to train")
    if eager:
        return Fusion(False, "unfused: eager execution (debugging) runs each fold op by op")
    if shared_variables:
        return Fusion(False, f"unfused: the fold models share {shared_variables} variables (build(hp) "
                             "reuses layers between calls), so they cannot be trained as independent replicas")
    if choice == "off":
        return Fusion(False, "unfused: train.fused is false")
    if choice == "on":
        return Fusion(True, f"fused: {n_folds} folds in one compiled step (train.fused is true)")
    if "GPU" not in device and batch_size > FUSED_MAX_BATCH_ON_CPU:
        return Fusion(False, f"unfused: batch_size {batch_size} > {FUSED_MAX_BATCH_ON_CPU} on CPU, where fused "
                             "steps were measured no faster")
    return Fusion(True, f"fused: {n_folds} folds in one compiled step")


def shared_variable_count(models: Sequence[Any]) -> int:
    """How many variables belong to more than one of these models."""
    owners: dict[int, int] = {}
    for model in models:
        for variable in {id(v): v for v in model.variables}:
            owners[variable] = owners.get(variable, 0) + 1
    return sum(1 for count in owners.values() if count > 1)


class FusedFolds:
    """Trains fold engines one epoch at a time, all folds' steps in one compiled step."""

    def __init__(self, engines: Sequence[FoldEngine], *, jit_compile: bool):
        self._engines = list(engines)
        self._jit_compile = jit_compile
        # One compiled epoch per set of live folds: a fold that went NaN leaves the fused step.
        self._compiled: dict[tuple[int, ...], Any] = {}

    def train_epoch(self, epoch: int) -> dict[int, float]:
        """Train every live fold one epoch; returns the mean training loss by engine position.

        Folds can have different numbers of full batches (and different remainders): the steps
        all folds have are fused, the rest of each fold runs in its own loop afterwards, in the
        same order as unfused training would run them.
        """
        live = [i for i, engine in enumerate(self._engines) if engine.failure is None]
        if len(live) < 2:
            return {i: self._engines[i].train_epoch(epoch) for i in live}
        batches = {i: self._engines[i].epoch_batches(epoch) for i in live}
        shared_steps = min(len(full) for full, _ in batches.values())
        stacked = np.stack([batches[i][0][:shared_steps] for i in live], axis=1)
        started = time.perf_counter()
        fused_tallies = self._run_fused(tuple(live), stacked)
        fused_seconds = (time.perf_counter() - started) / len(live)
        losses = {}
        for i, tally in zip(live, fused_tallies):
            engine = self._engines[i]
            full, remainder = batches[i]
            started = time.perf_counter()
            if tally.failed_at < 0 and (len(full) > shared_steps or len(remainder)):
                tally = tally.then(engine.run_batches(full[shared_steps:], remainder), steps_before=shared_steps)
            # The fused step's time is shared evenly: the folds have the same batch size and model.
            engine.train_timer.add(fused_seconds + time.perf_counter() - started, len(full) * engine.batch_size
                                   + len(remainder))
            losses[i] = engine.close_epoch(epoch, tally)
        return losses

    def _run_fused(self, live: tuple[int, ...], stacked: np.ndarray) -> list[EpochTally]:
        import tensorflow as tf

        if live not in self._compiled:
            self._compiled[live] = self._compile([self._engines[i] for i in live])
        with tf.device(self._engines[live[0]].device):
            batches = tf.constant(stacked)
        loss_sum, trained, failed_at, last_loss, last_norm = (
            np.asarray(value) for value in self._compiled[live](batches))
        return [EpochTally(float(loss_sum[j]), int(trained[j]), int(failed_at[j]), float(last_loss[j]),
                           float(last_norm[j])) for j in range(len(live))]

    def _compile(self, engines: Sequence[FoldEngine]) -> Any:
        import tensorflow as tf

        steps = [engine.train_step for engine in engines]
        batch_size = engines[0].batch_size
        count = len(engines)

        def fused_step(indices, enabled):
            results = [step(indices[j], enabled[j]) for j, step in enumerate(steps)]
            return tuple(tf.stack(list(column)) for column in zip(*results))

        step = tf.function(fused_step, jit_compile=self._jit_compile)

        def fused_epoch(batches):
            # Per-fold running totals as vectors; a fold that fails is disabled inside the step
            # (its update is not applied) from then on, and the loop ends when none is left.
            loss_sum = tf.zeros([count])
            trained = tf.zeros([count], tf.int32)
            failed_at = tf.fill([count], -1)
            last_loss = tf.zeros([count])
            last_norm = tf.zeros([count])
            for s in tf.range(tf.shape(batches)[0]):
                enabled = failed_at < 0
                if not tf.reduce_any(enabled):
                    break
                loss, norm, healthy = step(batches[s], enabled)
                applied = enabled & healthy
                failed_at = tf.where(enabled & ~healthy, s, failed_at)
                loss_sum += tf.where(applied, loss * batch_size, 0.0)
                trained += tf.where(applied, batch_size, 0)
                last_loss = tf.where(applied, loss, last_loss)
                last_norm = tf.where(applied, norm, last_norm)
            return loss_sum, trained, failed_at, last_loss, last_norm

        return tf.function(fused_epoch)
