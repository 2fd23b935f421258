"""Summaries of recorded trials: ranking, cv_results, NaN and throughput tables, plots.

Everything here reads ``TrialRecord``s (what MLflow holds), so ``foldsweep run`` and
``foldsweep report`` show the same thing. The vocabulary is scikit-learn's ``cv_results_``:
``param_<name>``, ``split{k}_val_<metric>``, ``mean_val_<metric>``, ``std_val_<metric>``,
``rank_val_<metric>``.
"""

from __future__ import annotations

import csv
import io
import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from rich.table import Table

from pipeline.spec import Objective
from pipeline.tracking import TrialRecord

METRICS = ("accuracy", "loss")
DESCRIPTION_BUDGET = 7500  # characters of a run description (MLflow keeps 8,000 of a tag)
THROUGHPUT_COLUMNS = ("train_samples_per_s", "eval_samples_per_s", "compile_s", "trial_wall_s")
NAN_COLUMNS = ("nan_failures",)
NAN_TAGS = ("nan_fold", "nan_epoch", "nan_step")


def _score(record: TrialRecord, key: str) -> float | None:
    value = record.metrics.get(key)
    return value if value is not None and math.isfinite(value) else None


def ranked(records: Sequence[TrialRecord], objective: Objective) -> list[TrialRecord]:
    """Trials that finished all their epochs with a finite score, best first (ties keep the
    order trials started). Pruned, NaN and failed trials are not ranked."""
    scored = [record for record in records if record.status == "ok" and _score(record, objective.key) is not None]
    return sorted(scored, key=lambda record: objective.sort_key(_score(record, objective.key)))


def leaderboard_table(records: Sequence[TrialRecord], objective: Objective, *, title: str = "") -> Table:
    """Rank, mean +- std of the objective over the folds, the params that differ; unranked last.

    Params every trial shares go in the caption, so the rows show only what was searched.
    """
    varying, shared = split_params(records)
    caption = " ".join(f"{key}={_short(value)}" for key, value in sorted(shared.items()))
    better = "higher" if objective.mode == "max" else "lower"
    table = Table(title=title or f"leaderboard ({objective.key}, {better} is better)",
                  caption=f"all trials: {caption}" if caption else None)
    table.add_column("rank", justify="right")
    table.add_column("trial")
    table.add_column(f"val_{objective.metric}", justify="right")
    table.add_column("status")
    table.add_column("params")
    ordered = ranked(records, objective)
    for rank, record in enumerate(ordered, start=1):
        score = (f"{record.metrics[objective.key]:.4f} ± "
                 f"{record.metrics.get(objective.spread_key, float('nan')):.4f}")
        table.add_row(str(rank), record.run_name, score, record.status, _params_text(record, varying))
    for record in records:
        if record not in ordered:
            table.add_row("-", record.run_name, "-", _status_text(record), _params_text(record, varying))
    return table


def _status_text(record: TrialRecord) -> str:
    status = record.status or record.state.lower()
    if status == "nan":
        tags = record.tags
        return f"nan (fold {tags.get('nan_fold')}, epoch {tags.get('nan_epoch')}, step {tags.get('nan_step')})"
    return status


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


def cv_results(records: Sequence[TrialRecord]) -> list[dict[str, Any]]:
    """One row per trial, like scikit-learn's ``cv_results_``, plus status, NaN and throughput."""
    param_names = sorted({key for record in records for key in record.params})
    n_splits = 1 + max((int(match.group(1)) for record in records for key in record.metrics
                        if (match := re.match(r"split(\d+)_val_", key))), default=-1)
    ranks = {metric: _ranks(records, Objective.for_metric(metric)) for metric in METRICS}
    rows = []
    for record in records:
        row: dict[str, Any] = {"run_id": record.run_id, "trial_id": record.trial_id, "status": record.status}
        row.update({f"param_{name}": record.params.get(name, "") for name in param_names})
        for metric in METRICS:
            for k in range(n_splits):
                row[f"split{k}_val_{metric}"] = record.metrics.get(f"split{k}_val_{metric}", "")
            for stat in ("mean", "std"):
                row[f"{stat}_val_{metric}"] = record.metrics.get(f"{stat}_val_{metric}", "")
            row[f"rank_val_{metric}"] = ranks[metric].get(record.run_id, "")
        row["mean_train_loss"] = record.metrics.get("mean_train_loss", "")
        for column in (*THROUGHPUT_COLUMNS, *NAN_COLUMNS):
            row[column] = record.metrics.get(column, "")
        row.update({tag: record.tags.get(tag, "") for tag in NAN_TAGS})
        rows.append(row)
    return rows


def _ranks(records: Sequence[TrialRecord], objective: Objective) -> dict[str, int]:
    """scikit-learn's ranking: 1 is best, equal scores share the lower rank."""
    ordered = ranked(records, objective)
    ranks: dict[str, int] = {}
    for position, record in enumerate(ordered, start=1):
        previous = ordered[position - 2] if position > 1 else None
        tied = previous is not None and previous.metrics[objective.key] == record.metrics[objective.key]
        ranks[record.run_id] = ranks[previous.run_id] if tied else position
    return ranks


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return ""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _group(record: TrialRecord) -> tuple[int | None, str]:
    batch = record.params.get("batch_size")
    return (int(batch) if batch is not None else None, record.params.get("clipping", "none"))


def nan_table_rows(records: Sequence[TrialRecord]) -> list[dict[str, Any]]:
    """Per (batch size, clipping kind): how many trials, and how many went NaN."""
    groups: dict[tuple[int | None, str], list[TrialRecord]] = {}
    for record in records:
        groups.setdefault(_group(record), []).append(record)
    return [
        {"batch_size": batch, "clipping": clipping, "trials": len(members),
         "nan": sum(member.status == "nan" for member in members),
         "nan_folds": int(sum(member.metrics.get("nan_failures", 0) for member in members))}
        for (batch, clipping), members in sorted(groups.items(), key=lambda item: (item[0][0] or 0, item[0][1]))
    ]


def throughput_rows(records: Sequence[TrialRecord]) -> list[dict[str, Any]]:
    """Per batch size: median training and evaluation samples/s, compile seconds, trial wall time."""
    import statistics

    groups: dict[int | None, list[TrialRecord]] = {}
    for record in records:
        if "train_samples_per_s" in record.metrics:
            groups.setdefault(_group(record)[0], []).append(record)
    rows = []
    for batch, members in sorted(groups.items(), key=lambda item: item[0] or 0):
        row: dict[str, Any] = {"batch_size": batch, "trials": len(members)}
        for column in THROUGHPUT_COLUMNS:
            values = [m.metrics[column] for m in members if math.isfinite(m.metrics.get(column, math.nan))]
            row[column] = statistics.median(values) if values else math.nan
        rows.append(row)
    return rows


def rows_table(rows: Sequence[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for column in (rows[0] if rows else {}):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(_cell(value) for value in row.values()))
    return table


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else (f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}")
    return "-" if value is None else str(value)


def sweep_description(records: Sequence[TrialRecord], objective: Objective, *, sweep_name: str,
                      test_scores: Mapping[str, float] = {}, rerun_command: str | None = None) -> str:
    """The parent run's description, in Markdown: the leaderboard (the params that vary), the
    NaN table (batch size x clipping), the refit's test scores and how to rerun the best trial."""
    varying, shared = split_params(records)
    better = "higher" if objective.mode == "max" else "lower"
    lines = [f"## {sweep_name}: {len(records)} trials, ranked by {objective.key} ({better} is better)", "",
             "| rank | trial | " + f"{objective.key} ± std | status | " + " | ".join(varying) + " |",
             "|" + " --- |" * (4 + len(varying))]
    ordered = ranked(records, objective)
    rows = []
    for position, record in enumerate([*ordered, *(r for r in records if r not in ordered)], start=1):
        rank = str(position) if record in ordered else "-"
        score = (f"{record.metrics[objective.key]:.4f} ± {record.metrics.get(objective.spread_key, math.nan):.4f}"
                 if record in ordered else "-")
        cells = [rank, record.run_name, score, _status_text(record),
                 *(_short(record.params.get(name, "-")) for name in varying)]
        rows.append("| " + " | ".join(cells) + " |")
    # MLflow keeps at most 8,000 characters of a tag: the best rows fit, the rest is in cv_results.csv.
    budget = DESCRIPTION_BUDGET - 2000  # room for the NaN table, refit and rerun sections
    shown = 0
    while shown < len(rows) and sum(len(row) + 1 for row in rows[:shown + 1]) < budget:
        shown += 1
    lines += rows[:shown]
    if shown < len(rows):
        lines.append(f"| … | {len(rows) - shown} more trials in `cv_results.csv` | | |" + " |" * len(varying))
    if shared:
        lines += ["", "All trials: " + ", ".join(f"`{key}={_short(value)}`" for key, value in sorted(shared.items()))]
    nan_rows = nan_table_rows(records)
    lines += ["", "### NaN failures by batch size and clipping", "", "| batch_size | clipping | trials | NaN |",
              "| --- | --- | --- | --- |"]
    lines += [f"| {row['batch_size']} | {row['clipping']} | {row['trials']} | {row['nan']} |" for row in nan_rows]
    if test_scores:
        lines += ["", "### Refit of the best trial on the held-out test split", "",
                  ", ".join(f"{key} **{value:.4f}**" for key, value in sorted(test_scores.items()))]
    if rerun_command:
        lines += ["", "### Rerun the best trial", "", f"```\n{rerun_command}\n```"]
    return ("\n".join(lines) + "\n")[:DESCRIPTION_BUDGET]


def trial_description(record: TrialRecord, records: Sequence[TrialRecord], objective: Objective) -> str:
    """A trial run's description: its rank among the sweep's trials and its status."""
    ordered = ranked(records, objective)
    if record in ordered:
        score = record.metrics[objective.key]
        return (f"Rank **{ordered.index(record) + 1}** of {len(ordered)} ranked trials: {objective.key} "
                f"{score:.4f} ± {record.metrics.get(objective.spread_key, math.nan):.4f}; status {record.status}.")
    return f"Not ranked: status {_status_text(record)}."
