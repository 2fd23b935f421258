"""Folds one after another: each fold's compiled epoch loop in an execution of its own.

The layout of a trial whose folds are not fused (``pipeline.contract.plan`` says why: one fold,
eager or numerically checked debugging, models sharing variables, ``train.fused: false``); the
others train every fold in one execution (``pipeline.engine.side_by_side``,
``pipeline.engine.stacked``).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.engine.fold_engine import FoldEngine


class SequentialFolds:
    """Trains fold engines one epoch at a time, one fold after another."""

    def __init__(self, engines: Sequence[FoldEngine]):
        self._engines = list(engines)

    def train_epoch(self, epoch: int, live: tuple[int, ...]) -> dict[int, float]:
        return {i: self._engines[i].train_epoch(epoch) for i in live}
