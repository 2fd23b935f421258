"""Where a wall clock went: a time account, in named parts that add up to it.

A trial's account splits its ``trial_wall_s`` into start-up, compiling, training launches,
validation and the gaps between epochs (``pipeline.contract.results.TRIAL_PARTS``); what no part
measured is ``other_s``, so the parts and ``other_s`` always add up to the wall clock, and a large
``other_s`` says the account misses something. The account itself knows no trial: a sweep's
account of its fixed cost is the same shape with other parts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

OTHER_S = "other_s"


@dataclass(frozen=True)
class TimeAccount:
    """A wall clock and the seconds of each measured part of it, in order."""

    wall_s: float
    parts: tuple[tuple[str, float], ...]

    @classmethod
    def of(cls, wall_s: float, **parts: float) -> TimeAccount:
        return cls(float(wall_s), tuple((name, float(seconds)) for name, seconds in parts.items()))

    @property
    def other_s(self) -> float:
        """The wall clock no part measured (small when the account is complete)."""
        return self.wall_s - sum(seconds for _, seconds in self.parts)

    def as_dict(self) -> dict[str, float]:
        """Each part's seconds, then ``other_s``."""
        return {**dict(self.parts), OTHER_S: self.other_s}

    def shares(self) -> dict[str, float]:
        """Each part's (and ``other_s``') share of the wall clock."""
        return {
            name: seconds / self.wall_s if self.wall_s > 0 else math.nan for name, seconds in self.as_dict().items()
        }

    @classmethod
    def read(cls, values: Mapping[str, float], *, wall: str, parts: Sequence[str]) -> TimeAccount | None:
        """The account recorded in ``values`` under ``wall`` and ``parts`` (a part missing or
        not measured, NaN, counts as none of the time); None without the wall clock or any part
        (a record from before accounts were kept)."""
        if wall not in values or not any(name in values for name in parts):
            return None

        def seconds(name: str) -> float:
            value = float(values.get(name, 0.0))
            return value if math.isfinite(value) else 0.0

        return cls(float(values[wall]), tuple((name, seconds(name)) for name in parts))


@dataclass(frozen=True)
class Span:
    """From ``start`` to ``end``, seconds on one wall clock (``time.time()``)."""

    start: float
    end: float


def sweep_account(
    *, started: float, ended: float, trials: Sequence[Span], refit_s: float = 0.0, parts: Sequence[str]
) -> TimeAccount:
    """A sweep's wall clock from the command's start to its end, in the five ``parts`` (names in
    this order): until the first trial's first training step; while at least one trial trains
    (each ``trials`` span runs from its first step to its last report); while none does, between
    the first step and the last report; the refit; and the rest of the end (recording, the
    tables). Everything but the training and the refit is the sweep's fixed cost."""
    spans = sorted((max(span.start, started), min(span.end, ended)) for span in trials)
    spans = [(start, end) for start, end in spans if end > start]
    if not spans:
        return TimeAccount.of(ended - started, **dict(zip(parts, (ended - started - refit_s, 0.0, 0.0, refit_s, 0.0))))
    training, reach = 0.0, spans[0][0]
    for start, end in spans:  # the union of the spans
        if end > reach:
            training += end - max(start, reach)
            reach = end
    first, last = spans[0][0], reach
    idle = (last - first) - training
    finish = max(0.0, ended - last - refit_s)
    return TimeAccount.of(ended - started, **dict(zip(parts, (first - started, training, idle, refit_s, finish))))
