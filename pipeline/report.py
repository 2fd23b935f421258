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
from typing import Any, Sequence

from rich.table import Table

from pipeline.spec import Objective
from pipeline.tracking import Tracker, TrialRecord

METRICS = ("accuracy", "loss")
THROUGHPUT_COLUMNS = ("train_samples_per_s", "eval_samples_per_s", "compile_s", "trial_wall_s")
NAN_COLUMNS = ("nan_failures",)
NAN_TAGS = ("nan_fold", "nan_epoch", "nan_step")
PLOTS = ("score_vs_batch_size.png", "nan_rate_heatmap.png", "throughput_vs_batch_size.png")


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


def write_plots(records: Sequence[TrialRecord], objective: Objective, directory: Path) -> list[Path]:
    """The three sweep plots as PNG files in ``directory``; returns their paths."""
    key = objective.key
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / name for name in PLOTS]
    kinds = sorted({_group(record)[1] for record in records})
    batches = sorted({b for b in (_group(record)[0] for record in records) if b is not None})

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for kind in kinds:
        members = [r for r in records if _group(r)[1] == kind and r.status in ("ok", "pruned")
                   and _score(r, key) is not None and _group(r)[0] is not None]
        axes.scatter([_group(r)[0] for r in members], [r.metrics[key] for r in members], label=kind, alpha=0.8)
    failed = [r for r in records if r.status == "nan" and _group(r)[0] is not None]
    if failed:
        bottom = min((r.metrics.get(key, 0.0) for r in records if _score(r, key) is not None), default=0.0)
        axes.scatter([_group(r)[0] for r in failed], [bottom] * len(failed), marker="x", color="red", label="NaN")
    _batch_axis(axes, batches)
    axes.set_ylabel(key)
    axes.set_title(f"{key} vs batch size, by gradient clipping")
    axes.legend(title="clipping")
    figure.tight_layout()
    figure.savefig(paths[0], dpi=100)
    plt.close(figure)

    rates = np.full((len(kinds), max(len(batches), 1)), np.nan)
    labels = [["" for _ in range(rates.shape[1])] for _ in kinds]
    for row in nan_table_rows(records):
        if row["batch_size"] is None:
            continue
        i, j = kinds.index(row["clipping"]), batches.index(row["batch_size"])
        rates[i, j] = row["nan"] / row["trials"]
        labels[i][j] = f"{row['nan']}/{row['trials']}"
    figure, axes = plt.subplots(figsize=(7, 3.5))
    image = axes.imshow(rates, cmap="Reds", vmin=0, vmax=1, aspect="auto")
    axes.set_xticks(range(len(batches)), [str(b) for b in batches])
    axes.set_yticks(range(len(kinds)), kinds)
    for i in range(len(kinds)):
        for j in range(len(batches)):
            axes.text(j, i, labels[i][j], ha="center", va="center", fontsize=9)
    axes.set_xlabel("batch size")
    axes.set_ylabel("clipping")
    axes.set_title("share of trials that went NaN")
    figure.colorbar(image, ax=axes)
    figure.tight_layout()
    figure.savefig(paths[1], dpi=100)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(7, 4.5))
    measured = [r for r in records if math.isfinite(r.metrics.get("train_samples_per_s", math.nan))
                and _group(r)[0] is not None]
    axes.scatter([_group(r)[0] for r in measured], [r.metrics["train_samples_per_s"] for r in measured], alpha=0.8)
    _batch_axis(axes, batches)
    axes.set_ylabel("training samples/s (all folds, compilation excluded)")
    axes.set_title("training throughput vs batch size")
    figure.tight_layout()
    figure.savefig(paths[2], dpi=100)
    plt.close(figure)
    return paths


def _batch_axis(axes: Any, batches: Sequence[int]) -> None:
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(batches), [str(batch) for batch in batches])
    axes.minorticks_off()
    axes.set_xlabel("batch size")


def publish(tracker: Tracker, parent_run_id: str, records: Sequence[TrialRecord], objective: Objective) -> None:
    """Write (or refresh) the sweep's tables and plots as artifacts of its parent run."""
    import tempfile

    texts = {"cv_results.csv": to_csv(cv_results(records)), "nan_summary.csv": to_csv(nan_table_rows(records))}
    with tempfile.TemporaryDirectory() as directory:
        plots = write_plots(records, objective, Path(directory))
        tracker.publish_sweep_files(parent_run_id, texts=texts, files={path: "plots" for path in plots})
