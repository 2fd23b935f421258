"""Summaries of recorded trials: ranking and the terminal leaderboard."""

from __future__ import annotations

import math
from typing import Sequence

from rich.table import Table

from pipeline.tracking import TrialRecord


def _score(record: TrialRecord, objective: str) -> float | None:
    value = record.metrics.get(objective)
    return value if value is not None and math.isfinite(value) else None


def ranked(records: Sequence[TrialRecord], objective: str, mode: str) -> list[TrialRecord]:
    """Finished trials with a finite score, best first (ties keep the order trials started)."""
    scored = [record for record in records if record.status == "ok" and _score(record, objective) is not None]
    sign = -1.0 if mode == "max" else 1.0
    return sorted(scored, key=lambda record: sign * _score(record, objective))


def leaderboard_table(records: Sequence[TrialRecord], objective: str, mode: str, *, title: str = "") -> Table:
    """Rank, mean +- std of the objective over the folds, the params that differ; unranked last.

    Params every trial shares go in the caption, so the rows show only what was searched.
    """
    spread = objective.replace("mean_", "std_", 1)
    varying, shared = split_params(records)
    caption = " ".join(f"{key}={_short(value)}" for key, value in sorted(shared.items()))
    table = Table(title=title or f"leaderboard ({objective}, {'higher' if mode == 'max' else 'lower'} is better)",
                  caption=f"all trials: {caption}" if caption else None)
    table.add_column("rank", justify="right")
    table.add_column("trial")
    table.add_column(objective.removeprefix("mean_"), justify="right")
    table.add_column("status")
    table.add_column("params")
    ordered = ranked(records, objective, mode)
    for rank, record in enumerate(ordered, start=1):
        score = f"{record.metrics[objective]:.4f} ± {record.metrics.get(spread, float('nan')):.4f}"
        table.add_row(str(rank), record.run_name, score, record.status, _params_text(record, varying))
    for record in records:
        if record not in ordered:
            table.add_row("-", record.run_name, "-", record.status or record.state.lower(),
                          _params_text(record, varying))
    return table


def split_params(records: Sequence[TrialRecord]) -> tuple[list[str], dict[str, str]]:
    """(names whose values differ between trials, {name: value} of those all trials share)."""
    names = sorted({key for record in records for key in record.params})
    values = {key: {record.params.get(key) for record in records} for key in names}
    varying = [key for key in names if len(values[key]) > 1]
    shared = {key: next(iter(values[key])) for key in names if len(values[key]) == 1}
    return varying, shared


def _params_text(record: TrialRecord, names: Sequence[str]) -> str:
    return " ".join(f"{key}={_short(record.params.get(key, '-'))}" for key in names)


def _short(value: str) -> str:
    try:
        number = float(value)
    except ValueError:
        return value
    if number.is_integer() and "." not in value and "e" not in value.lower():
        return value
    return f"{number:.4g}"
