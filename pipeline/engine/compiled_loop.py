"""The compiled epoch loop the fold layouts share: an epoch's tally of its training steps
(``EpochTally``, ``tally_step``), a launch as the ``tf.function`` the epoch calls, XLA-compiled
where the plan says (``compiled_launch``), and the loop of launches that trains an epoch in one
execution (``launch_loop``; one fold's epoch with its short last batch, ``epoch_loop``). One
fold's engine (``pipeline.engine.fold_engine``) and the stacked folds (``pipeline.engine.stacked``)
train through it alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from pipeline.base import compile_cache


class EpochTally(NamedTuple):
    """What a fold's training steps of an epoch add up to: the summed loss over trained samples,
    the samples trained, the step that failed (-1 while none has) and the last good step's loss
    and gradient norm. Tensors inside the compiled epoch (each with a fold axis when the folds
    are stacked), a nest TensorFlow carries through its loops and returns; Python numbers once
    the epoch has returned (``numbers``)."""

    loss_sum: Any
    trained: Any
    failed_at: Any
    last_loss: Any
    last_norm: Any

    @classmethod
    def start(cls, n_folds: int | None = None) -> EpochTally:
        """An epoch's tally before its first step, inside the compiled epoch: one fold's, or
        ``n_folds`` stacked folds'. Zeros, not NaN, for the last loss and norm, so that
        TensorFlow's numeric checking (rerun --check-numerics) only ever stops at a value the
        model produced. (Two forms, the ops each program has been traced with: its ops are its
        compile-cache key.)"""
        import tensorflow as tf

        if n_folds is None:
            return cls(tf.constant(0.0), tf.constant(0), tf.constant(-1), tf.constant(0.0), tf.constant(0.0))
        zeros = tf.zeros([n_folds])
        return cls(zeros, tf.zeros([n_folds], tf.int32), -tf.ones([n_folds], tf.int32), zeros, zeros)

    @property
    def failed(self) -> Any:
        """Whether a step failed (per fold, stacked), inside the compiled epoch."""
        return self.failed_at >= 0

    @property
    def intact(self) -> Any:
        """Whether no step has failed yet (per fold, stacked), inside the compiled epoch."""
        return self.failed_at < 0

    def numbers(self, fold: int | None = None) -> EpochTally:
        """The tally a compiled epoch returned, as Python numbers (of one ``fold`` of stacked folds')."""
        values = [np.asarray(value) if fold is None else np.asarray(value)[fold] for value in self]
        loss_sum, trained, failed_at, last_loss, last_norm = values
        return EpochTally(float(loss_sum), int(trained), int(failed_at), float(last_loss), float(last_norm))


def tally_step(
    tally: EpochTally, *, step: Any, loss: Any, norm: Any, healthy: Any, active: Any, samples: Any
) -> EpochTally:
    """The epoch tally after one training step (inside the compiled launch; per fold when the
    arguments carry a fold axis): a step that was active adds its loss and samples if healthy,
    else records where the fold failed."""
    import tensorflow as tf

    applied = healthy & active
    return EpochTally(
        tally.loss_sum + tf.where(applied, loss * tf.cast(samples, loss.dtype), 0.0),
        tally.trained + tf.where(applied, tf.cast(samples, tally.trained.dtype), 0),
        tf.where(active & ~healthy, step, tally.failed_at),
        tf.where(applied, loss, tally.last_loss),
        tf.where(applied, norm, tally.last_norm),
    )


def compiled_launch(train_steps: Callable[..., Any], *, jit_compile: bool) -> Callable[..., Any]:
    """A launch as a ``tf.function`` for an epoch's function to call, XLA-compiled where
    ``jit_compile``. TensorFlow inlines every function a function marked ``jit_compile`` calls
    before XLA lowers it, however they are marked; so the launch is not marked, its call in the
    epoch is: XLA compiles the same launch, and the step it calls (``traced_once``) is lowered
    once, not once per unrolled step."""
    import tensorflow as tf

    launch = tf.function(train_steps, autograph=False, jit_compile=None if jit_compile else False)
    if not jit_compile:
        return launch

    def call(*arguments: Any) -> Any:
        outputs = launch(*arguments)
        (operation,) = {tensor.op for tensor in tf.nest.flatten(outputs)}
        compile_cache.compile_call(operation)
        return outputs

    return call


def launch_loop(
    steps: Callable[..., Any],
    batches: tuple[Any, ...],
    tally: EpochTally,
    *,
    steps_per_launch: int,
    stopped: Callable[[EpochTally], Any] | None,
) -> EpochTally:
    """An epoch's training steps as one graph loop (inside the epoch's ``tf.function``):
    ``steps_per_launch`` of them per compiled launch, then the steps that do not fill a launch one
    per launch, left as soon as ``stopped(tally)``; with ``stopped`` None (the per-epoch stop
    test, masked steps) every launch runs and the loop never reads the tally. ``batches`` are the
    steps' arguments, each with the epoch's steps first; ``steps(*arguments of some steps, first
    step, tally)`` returns the tally after them. The fold engine and the stacked folds train
    through it alike."""
    import tensorflow as tf

    n_steps = tf.shape(batches[0])[0]
    launched = n_steps // steps_per_launch * steps_per_launch
    launches = [tf.reshape(batch[:launched], [-1, steps_per_launch, *batch.shape[1:]]) for batch in batches]
    n_launches = tf.shape(launches[0])[0]

    def next_launch(launch, tally):
        return launch + 1, steps(*(arguments[launch] for arguments in launches), launch * steps_per_launch, tally)

    def next_step(step, tally):
        return step + 1, steps(*(batch[step][tf.newaxis] for batch in batches), step, tally)

    if stopped is None:  # the counters are host integers (shapes): the loop reads no device value
        _, tally = tf.while_loop(lambda launch, tally: launch < n_launches, next_launch, (tf.constant(0), tally))
        _, tally = tf.while_loop(lambda step, tally: step < n_steps, next_step, (launched, tally))
        return tally
    # A fresh tally has not stopped, so testing before each launch is leaving right after the
    # one that stopped it.
    _, tally = tf.while_loop(
        lambda launch, tally: (launch < n_launches) & ~stopped(tally), next_launch, (tf.constant(0), tally)
    )
    _, tally = tf.while_loop(lambda step, tally: (step < n_steps) & ~stopped(tally), next_step, (launched, tally))
    return tally


def epoch_loop(
    steps: Callable[..., Any], *, steps_per_launch: int, per_epoch: bool, padded_to: int | None = None
) -> Callable[[Any, Any], Any]:
    """One fold's epoch, uncompiled: ``train_epoch(full_batches, remainder)`` runs the launches of
    ``steps`` over the full batches as one execution (``launch_loop``), then the remainder,
    shorter than a batch, as one more launch of its own, and returns the epoch's tally. With
    ``per_epoch`` (the plan's stop test) the steps are masked and the loop never reads the tally.
    With ``padded_to`` (the batch size, where the plan pads the last batch) the remainder runs
    padded to a full batch with copies of its first sample, each step told how many of its
    samples are its own (``FoldStepForm.padded``). Traced with a remainder of unknown length, the
    epoch serves every fold's (``fold_engine.shared_epochs``), its remainder run where it has one."""
    import tensorflow as tf

    def train_epoch(full_batches, remainder):
        n_steps = tf.shape(full_batches)[0]
        own = () if padded_to is None else (tf.fill([n_steps], padded_to),)
        tally = launch_loop(
            steps,
            (full_batches, *own),
            EpochTally.start(),
            steps_per_launch=steps_per_launch,
            stopped=None if per_epoch else lambda tally: tally.failed,
        )

        def last():
            if padded_to is None:
                return steps(remainder[tf.newaxis], n_steps, tally)
            # Padded to the batch size, the launch has the full batch's shape whatever the
            # remainder's length (known or not when traced): one program for every fold.
            own_rows = tf.shape(remainder)[0]
            padding = tf.fill([padded_to - own_rows], remainder[0])
            batch = tf.ensure_shape(tf.concat([remainder, padding], axis=0), [padded_to])
            return steps(batch[tf.newaxis], own_rows[tf.newaxis], n_steps, tally)

        remaining = remainder.shape[0]
        if remaining is None:  # traced for any fold's remainder (``shared_epochs``)
            runs = tf.size(remainder) > 0
            tally = tf.cond(runs if per_epoch else runs & tally.intact, last, lambda: tally)
        elif remaining:
            # Masked steps need no test: after a failure the remainder applies nothing.
            tally = last() if per_epoch else tf.cond(tally.failed, lambda: tally, last)
        return tally

    return train_epoch
