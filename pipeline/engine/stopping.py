"""A trial's own early stopping: Keras' ``EarlyStopping`` rule, applied to the trial's mean CV
curve, one decision for all its replicas (never per fold).

Keras' rule, kept exactly so that a hypermodel's ``EarlyStopping`` means here what it means in
``fit``: an epoch before ``start_from_epoch`` is not watched; every watched epoch adds one to
``wait``; one that beats the best so far by more than ``min_delta`` becomes the best and, when it
also beats ``baseline`` (if any), resets ``wait``; the trial stops once ``wait`` reaches
``patience``. So with ``min_delta`` 0 a trial stops ``patience`` epochs after its best one.

The curve watched is the mean over the folds that are still training: a fold that went NaN
counts as the worst score in the recorded CV mean, which is no sign that the others stopped
improving.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.inputs.spec import EarlyStoppingSpec


@dataclass
class Patience:
    """The state of one trial's rule; ``state``/``restore`` carry it through a checkpoint."""

    rule: EarlyStoppingSpec
    best: float = math.nan
    wait: int = 0

    def observe(self, epoch: int, live_scores: Sequence[float]) -> bool:
        """Whether the trial stops after ``epoch`` (1-based), given its live folds' scores of
        ``rule.monitor`` at that epoch."""
        finite = [score for score in live_scores if math.isfinite(score)]
        if not finite or epoch <= self.rule.start_from_epoch:
            return False
        current = sum(finite) / len(finite)
        self.wait += 1
        if self._improves(current, self.best):
            self.best = current
            if self.rule.baseline is None or self._improves(current, self.rule.baseline):
                self.wait = 0
            return False
        return self.wait >= self.rule.patience and epoch > 1

    def _improves(self, value: float, reference: float) -> bool:
        if math.isnan(reference):
            return True
        if self.rule.objective.mode == "max":
            return value - self.rule.min_delta > reference
        return value + self.rule.min_delta < reference

    def state(self) -> tuple[float, int]:
        return self.best, self.wait

    def restore(self, state: Sequence[float]) -> None:
        self.best, self.wait = float(state[0]), int(state[1])
