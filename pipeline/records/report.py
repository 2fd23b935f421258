"""Summaries of recorded trials: ranking, cv_results, NaN and throughput tables, plots.

Everything here reads ``TrialRecord``s (what MLflow holds), so ``foldsweep run`` and
``foldsweep report`` show the same thing. The vocabulary is scikit-learn's ``cv_results_``:
``param_<name>``, ``split{k}_val_<metric>``, ``mean_val_<metric>``, ``std_val_<metric>``,
``rank_val_<metric>``. A trial's scores are those of its selected epoch (``best_epoch``,
``train.select``), and ``Standings`` compares every ranked trial with the best on the same
replicas (``pvalue_vs_best``, pipeline.records.significance).
"""

from __future__ import annotations

import csv
import io
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from pipeline.contract.account import TimeAccount
from pipeline.contract.results import (
    BEST_EPOCH,
    COMPILE_S,
    EVAL_RATE,
    NAN_EPOCH,
    NAN_FAILURES,
    NAN_FOLD,
    NAN_STEP,
    SELECTED_PREFIX,
    TRAIN_RATE,
    TRIAL_WALL_S,
    TrialStatus,
    split_key,
    sweep_fixed_s,
    trial_account,
)
from pipeline.inputs.spec import NO_CLIPPING, Objective
from pipeline.records.significance import SIGNIFICANCE_LEVEL, Comparison, corrected_ttest, val_train_ratio
from pipeline.records.stores import sqlite_path
from pipeline.records.tracking import TRACKING_URI_VARIABLE, Tag, TrialRecord

# The scores every classifier's trials are ranked by in cv_results.csv, besides the objective.
METRICS = ("accuracy", "loss")
DESCRIPTION_BUDGET = 7500  # characters of a run description (MLflow keeps 8,000 of a tag)
THROUGHPUT_COLUMNS = (TRAIN_RATE, EVAL_RATE, COMPILE_S, TRIAL_WALL_S)
NAN_COLUMNS = (NAN_FAILURES,)
NAN_TAGS = (NAN_FOLD, NAN_EPOCH, NAN_STEP)


def selected_score(record: TrialRecord, key: str) -> float | None:
    """A trial's CV score ``key`` at its selected epoch (at its last epoch for a trial recorded
    without a selection); None when not finite."""
    value = record.metrics.get(f"{SELECTED_PREFIX}{key}", record.metrics.get(key))
    return value if value is not None and math.isfinite(value) else None


def selected_epoch(record: TrialRecord) -> int | None:
    epoch = record.metrics.get(BEST_EPOCH)
    return int(epoch) if epoch is not None else None


def ranked(records: Sequence[TrialRecord], objective: Objective) -> list[TrialRecord]:
    """Trials that finished all their epochs with a finite score, best first by the score at
    their selected epoch (ties keep the order trials started). Pruned, NaN and failed trials are
    not ranked."""
    scored = [
        (record, score)
        for record in records
        if record.status is TrialStatus.OK and (score := selected_score(record, objective.key)) is not None
    ]
    return [record for record, _ in sorted(scored, key=lambda scored_record: objective.sort_key(scored_record[1]))]


def replica_scores(record: TrialRecord, objective: Objective) -> list[float]:
    """The objective's metric on each replica (``split{j}``), at the trial's selected epoch."""
    scores: list[float] = []
    while (value := selected_score(record, split_key(len(scores), objective.fold_key))) is not None:
        scores.append(value)
    return scores


@dataclass(frozen=True)
class Standings:
    """A sweep's ranked trials, best first, and each one's comparison with the best on the same
    replicas (the corrected resampled t-test; the best against itself gives p = 1)."""

    records: tuple[TrialRecord, ...]
    objective: Objective
    ranked: tuple[TrialRecord, ...]
    comparisons: Mapping[str, Comparison]  # run id -> against the best
    replicas: int
    ranks: Mapping[str, int] = field(default_factory=dict)  # run id -> rank, equal scores sharing one

    @classmethod
    def of(cls, records: Sequence[TrialRecord], objective: Objective, *, n_splits: int | None) -> Standings:
        """``n_splits`` folds per repeat give the correction's ``n_val/n_train``; without it
        (a sweep recorded before it was a param) there are no comparisons."""
        ordered = ranked(records, objective)
        best = replica_scores(ordered[0], objective) if ordered else []
        comparisons: dict[str, Comparison] = {}
        if n_splits and n_splits >= 2 and len(best) >= 2:
            for record in ordered:
                other = replica_scores(record, objective)
                if len(other) == len(best):
                    differences = [objective.sort_key(o) - objective.sort_key(b) for o, b in zip(other, best)]
                    comparisons[record.run_id] = corrected_ttest(differences, val_train_ratio=val_train_ratio(n_splits))
        return cls(tuple(records), objective, tuple(ordered), comparisons, len(best), shared_ranks(records, objective))

    def rank(self, record: TrialRecord) -> int | None:
        """scikit-learn's rank (equal scores share the lower one), as the leaderboard, cv_results.csv
        and the descriptions all show it; None for a trial that is not ranked."""
        return self.ranks.get(record.run_id)

    def pvalue(self, record: TrialRecord) -> float | None:
        comparison = self.comparisons.get(record.run_id)
        return comparison.pvalue if comparison is not None else None

    def tied(self, record: TrialRecord) -> bool | None:
        """Statistically indistinguishable from the best (the best itself too); None when not compared."""
        comparison = self.comparisons.get(record.run_id)
        return comparison.tied if comparison is not None else None

    def tied_with_best(self) -> list[TrialRecord]:
        """Ranked trials below the best that are statistically indistinguishable from it."""
        return [record for record in self.ranked[1:] if self.tied(record)]

    def versus_best(self, record: TrialRecord) -> str:
        """``best``, ``tied (p=0.31)``, ``worse (p=0.004)``, or ``-`` (not compared)."""
        pvalue = self.pvalue(record)
        if self.ranked and record is self.ranked[0]:
            return "best"
        if pvalue is None:
            return "-"
        return f"{'tied' if pvalue >= SIGNIFICANCE_LEVEL else 'worse'} (p={_p_text(pvalue)})"

    def ties_line(self) -> str:
        """One line: how many trials are tied with the best, and by which test."""
        if not self.comparisons:
            return ""
        others = len(self.ranked) - 1
        tied = len(self.tied_with_best())
        test = (
            f"one-sided corrected resampled t-test over {self.replicas} replicas at each trial's selected epoch, "
            f"p >= {SIGNIFICANCE_LEVEL:g}"
        )
        if others == 0:
            return f"only one trial is ranked: nothing to compare the best with ({test})"
        return (
            f"{tied} of the {others} other ranked trials {'is' if tied == 1 else 'are'} statistically "
            f"indistinguishable from the best ({test})"
        )


def _p_text(pvalue: float) -> str:
    return f"{pvalue:.2g}" if pvalue < 0.01 else f"{pvalue:.2f}"


def _score_text(record: TrialRecord, objective: Objective) -> str:
    spread = selected_score(record, objective.spread_key)
    return f"{selected_score(record, objective.key):.4f} ± {spread if spread is not None else math.nan:.4f}"


def leaderboard_table(standings: Standings, *, title: str = "") -> Table:
    """Rank, mean +- std of the objective over the replicas at the selected epoch, that epoch,
    the comparison with the best, the params that differ; unranked last (``ties_line`` says in
    one line how many trials are tied with the best).

    Params every trial shares go in the caption, so the rows show only what was searched.
    """
    records, objective = standings.records, standings.objective
    varying, shared = split_params(records)
    caption = " ".join(f"{key}={_short(value)}" for key, value in sorted(shared.items()))
    better = "higher" if objective.mode == "max" else "lower"
    table = Table(
        title=title or f"leaderboard ({objective.key}, {better} is better)",
        caption=f"all trials: {caption}" if caption else None,
    )
    table.add_column("rank", justify="right")
    table.add_column("run id")
    table.add_column("trial")
    table.add_column(f"val_{objective.metric}", justify="right")
    table.add_column("epoch", justify="right")
    table.add_column("vs best")
    table.add_column("status")
    table.add_column("params")
    for record in standings.ranked:
        table.add_row(
            str(standings.rank(record)),
            short_run_id(record.run_id),
            record.label,
            _score_text(record, objective),
            _epoch_text(record),
            standings.versus_best(record),
            record.status,
            _params_text(record, varying),
        )
    for record in records:
        if record not in standings.ranked:
            table.add_row(
                "-",
                short_run_id(record.run_id),
                record.label,
                "-",
                "-",
                "-",
                status_text(record),
                _params_text(record, varying),
            )
    return table


# How much of an MLflow run id the leaderboard shows; `foldsweep rerun` takes it back (as git
# takes a short commit id), and the full id is in cv_results.csv and the UI.
SHORT_RUN_ID = 8


def short_run_id(run_id: str) -> str:
    return run_id[:SHORT_RUN_ID]


def rerun_command(standings: Standings, uri: str, *, program: str = "foldsweep") -> str | None:
    """The command that reruns the best trial, as it can be pasted (the store's URI absolute, so
    that it works from any directory)."""
    import shlex

    from pipeline.records.stores import pasteable_uri

    if not standings.ranked:
        return None
    uri = pasteable_uri(uri)
    return f"{program} rerun {short_run_id(standings.ranked[0].run_id)} --tracking-uri {shlex.quote(uri)}"


def trial_line(record: TrialRecord, objective: str) -> str:
    """A trial as ``run`` prints it when it ends: ``  trial-00003 (1a2b3c4d): ok (mean_val_accuracy
    0.8123 at epoch 7)``, and the last line of its error."""
    score = selected_score(record, objective)
    # A NaN trial's CV mean counts its NaN folds as the worst score: not a score to show.
    shown = (
        f" ({objective} {score:.4f} at epoch {selected_epoch(record)})"
        if score is not None and record.status is not TrialStatus.NAN
        else ""
    )
    reason = record.error.strip().splitlines()[-1] if record.error.strip() else ""
    return f"  {record.label} ({short_run_id(record.run_id)}): {status_text(record)}{shown}{' - ' + reason if reason else ''}"


def _epoch_text(record: TrialRecord) -> str:
    epoch = selected_epoch(record)
    return str(epoch) if epoch is not None else "-"


def status_text(record: TrialRecord) -> str:
    """A trial's status, with where it went NaN for a NaN trial."""
    status = record.status or record.state.lower()
    if status is TrialStatus.NAN:
        fold, epoch, step = (record.tags.get(Tag.of(tag)) for tag in NAN_TAGS)
        return f"nan (fold {fold}, epoch {epoch}, step {step})"
    return status


# What a trial records of the optimizer in effect: where a hypermodel feeds it from a
# hyperparameter of its own (``lr``), the two are the same column twice.
IN_EFFECT_PARAMS = ("learning_rate", "optimizer")


def param_names(records: Sequence[TrialRecord]) -> list[str]:
    """Every param the trials recorded, one name per hyperparameter: an in-effect param whose
    values equal another param's in every trial is left out (the hypermodel's name is kept)."""
    names = sorted({key for record in records for key in record.params})

    def column(name: str) -> tuple[str | None, ...]:
        return tuple(record.params.get(name) for record in records)

    return [
        name
        for name in names
        if not (
            name in IN_EFFECT_PARAMS
            and any(
                other != name and other not in IN_EFFECT_PARAMS and column(other) == column(name) for other in names
            )
        )
    ]


def split_params(records: Sequence[TrialRecord]) -> tuple[list[str], dict[str, str]]:
    """(names whose values differ between trials, {name: value} of those all trials share)."""
    names = param_names(records)
    values = {key: {record.params.get(key) for record in records} for key in names}
    varying = [key for key in names if len(values[key]) > 1]
    # a name every trial shares has a value in each: names come from the trials' params
    shared = {key: value for key in names if len(values[key]) == 1 and (value := next(iter(values[key]))) is not None}
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


def cv_results(standings: Standings) -> list[dict[str, Any]]:
    """One row per trial, like scikit-learn's ``cv_results_`` (the scores of each trial's selected
    epoch, ``best_epoch``), plus the comparison with the best, status, NaN and throughput."""
    records = standings.records
    names = param_names(records)
    metrics = recorded_metrics(records, standings.objective)
    replicas = max(
        (len(replica_scores(record, Objective(metric))) for record in records for metric in metrics), default=0
    )
    # Ranked: the objective (in its direction), and loss and accuracy as before.
    objectives = {metric: Objective.for_metric(metric) for metric in METRICS if metric in metrics}
    objectives[standings.objective.metric] = standings.objective
    ranks = {metric: shared_ranks(records, objective) for metric, objective in objectives.items()}
    rows = []
    for record in records:
        row: dict[str, Any] = {
            "run_id": record.run_id,
            "trial_id": record.trial_id,
            "status": record.status,
            BEST_EPOCH: _blank(selected_epoch(record)),
        }
        row.update({f"param_{name}": record.params.get(name, "") for name in names})
        for metric in metrics:
            for k in range(replicas):
                row[split_key(k, f"val_{metric}")] = _blank(selected_score(record, split_key(k, f"val_{metric}")))
            for stat in ("mean", "std"):
                row[f"{stat}_val_{metric}"] = _blank(selected_score(record, f"{stat}_val_{metric}"))
            if metric in ranks:
                row[f"rank_val_{metric}"] = ranks[metric].get(record.run_id, "")
        row["pvalue_vs_best"] = _blank(standings.pvalue(record))
        row["tied_with_best"] = _blank(standings.tied(record))
        row["mean_train_loss"] = _blank(selected_score(record, "mean_train_loss"))
        for column in (*THROUGHPUT_COLUMNS, *NAN_COLUMNS):
            row[column] = record.metrics.get(column, "")
        row.update({tag: record.tags.get(Tag.of(tag), "") for tag in NAN_TAGS})
        rows.append(row)
    return rows


def recorded_metrics(records: Sequence[TrialRecord], objective: Objective) -> list[str]:
    """The validation metrics the trials recorded (``mean_val_<name>``): loss and accuracy first,
    then the objective, then the others by name."""
    found = {
        key.removeprefix(f"{SELECTED_PREFIX}mean_val_").removeprefix("mean_val_")
        for record in records
        for key in record.metrics
        if key.startswith(("mean_val_", f"{SELECTED_PREFIX}mean_val_"))
    }
    first = [metric for metric in (*METRICS, objective.metric) if metric in found or metric == objective.metric]
    return list(dict.fromkeys([*first, *sorted(found - set(first))]))


def _blank(value: Any) -> Any:
    return "" if value is None else value


def shared_ranks(records: Sequence[TrialRecord], objective: Objective) -> dict[str, int]:
    """scikit-learn's ranking: 1 is best, equal scores share the lower rank."""
    ordered = ranked(records, objective)
    ranks: dict[str, int] = {}
    for position, record in enumerate(ordered, start=1):
        previous = ordered[position - 2] if position > 1 else None
        if previous is not None and selected_score(previous, objective.key) == selected_score(record, objective.key):
            ranks[record.run_id] = ranks[previous.run_id]
        else:
            ranks[record.run_id] = position
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
    return (int(batch) if batch is not None else None, record.params.get("clipping", NO_CLIPPING))


def nan_table_rows(records: Sequence[TrialRecord]) -> list[dict[str, Any]]:
    """Per (batch size, clipping kind): how many trials, and how many went NaN."""
    groups: dict[tuple[int | None, str], list[TrialRecord]] = {}
    for record in records:
        groups.setdefault(_group(record), []).append(record)
    return [
        {
            "batch_size": batch,
            "clipping": clipping,
            "trials": len(members),
            "nan": sum(member.status is TrialStatus.NAN for member in members),
            "nan_folds": int(sum(member.metrics.get(NAN_FAILURES, 0) for member in members)),
        }
        for (batch, clipping), members in sorted(groups.items(), key=lambda item: (item[0][0] or 0, item[0][1]))
    ]


def throughput_rows(records: Sequence[TrialRecord]) -> list[dict[str, Any]]:
    """Per batch size: median training and evaluation samples/s, compile seconds, trial wall time."""
    import statistics

    groups: dict[int | None, list[TrialRecord]] = {}
    for record in records:
        if TRAIN_RATE in record.metrics:
            groups.setdefault(_group(record)[0], []).append(record)
    rows = []
    for batch, members in sorted(groups.items(), key=lambda item: item[0] or 0):
        row: dict[str, Any] = {"batch_size": batch, "trials": len(members)}
        for column in THROUGHPUT_COLUMNS:
            values = [m.metrics[column] for m in members if math.isfinite(m.metrics.get(column, math.nan))]
            row[column] = statistics.median(values) if values else math.nan
        rows.append(row)
    return rows


def account_rows(records: Sequence[TrialRecord]) -> list[dict[str, Any]]:
    """Per trial with a time account (in the order given), its wall clock and where it went,
    each part as seconds and share; then the same summed over those trials."""
    accounts = [(record.label, account) for record in records if (account := trial_account(record.metrics)) is not None]
    if not accounts:
        return []
    total = TimeAccount(
        sum(account.wall_s for _, account in accounts),
        tuple((name, sum(dict(account.parts)[name] for _, account in accounts)) for name, _ in accounts[0][1].parts),
    )
    return [
        {
            "trial": label,
            TRIAL_WALL_S: account.wall_s,
            **{
                name: _seconds_share(seconds, share, between="\n")
                for (name, seconds), share in zip(account.as_dict().items(), account.shares().values())
            },
        }
        for label, account in [*accounts, (f"all {len(accounts)}", total)]
    ]


def _seconds_share(seconds: float, share: float, *, between: str = " ") -> str:
    return f"{seconds:.2f}{between}{share:.0%}" if math.isfinite(share) else f"{seconds:.2f}"


def account_table(rows: Sequence[dict[str, Any]]) -> Table:
    """The accounts as a table that fits an 80-column terminal: each part's share under its seconds."""
    table = Table(title="where each trial's time went (seconds, share)", box=None, pad_edge=False, header_style="bold")
    for column in rows[0] if rows else {}:
        table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*(_cell(value) for value in row.values()))
    return table


def account_text(account: TimeAccount) -> str:
    """``12.3 s wall: setup_s 3.10 (25%), compile_s ...``: a trial's account on one line."""
    return f"{account.wall_s:.2f} s wall: " + ", ".join(
        f"{name} {_seconds_share(seconds, share)}"
        for (name, seconds), share in zip(account.as_dict().items(), account.shares().values())
    )


def sweep_account_text(account: TimeAccount) -> str:
    """A sweep's account on one line, its fixed cost (start, idle and end) last."""
    return f"{account_text(account)}; fixed cost {sweep_fixed_s(account):.1f} s (sweep_fixed_s)"


def compile_share(records: Sequence[TrialRecord]) -> tuple[float, float, int] | None:
    """The trials' summed ``compile_s``, their summed ``trial_wall_s`` and how many trials both
    count (those that recorded both); None where none did."""
    pairs = [
        (record.metrics[COMPILE_S], record.metrics[TRIAL_WALL_S])
        for record in records
        if math.isfinite(record.metrics.get(COMPILE_S, math.nan))
        and math.isfinite(record.metrics.get(TRIAL_WALL_S, math.nan))
    ]
    if not pairs or sum(wall for _, wall in pairs) <= 0:
        return None
    return sum(seconds for seconds, _ in pairs), sum(wall for _, wall in pairs), len(pairs)


def compile_share_text(records: Sequence[TrialRecord]) -> str | None:
    """``compile share 24%: compile_s 80.9 s of the 8 trials' summed trial_wall_s 340.1 s``."""
    share = compile_share(records)
    if share is None:
        return None
    compiling, wall, trials = share
    counted = "trial's" if trials == 1 else f"{trials} trials' summed"
    return f"compile share {compiling / wall:.0%}: {COMPILE_S} {compiling:.1f} s of the {counted} {TRIAL_WALL_S} {wall:.1f} s"


def refit_model_lines(tags: Mapping[str, str], tracking_uri: str, *, tools: Path | None = None) -> list[str]:
    """The refit's logged model (a parent run's tags) and how to load and serve it, by the
    ``python`` and ``mlflow`` of ``tools`` (a directory; None: the ones on the PATH): [] for a
    sweep that logged none."""
    model_uri = tags.get(Tag.REFIT_MODEL, "")
    if not model_uri.startswith("models:/"):  # none, or what failed ("error: ..."), said as it failed
        return []
    lines = [f"refit model {model_uri} (Keras flavor; the experiment module saved with it)"]
    registered = tags.get(Tag.REGISTERED_MODEL, "")
    if registered.startswith("models:/"):
        lines.append(f"registered as {registered}")
    database = sqlite_path(tracking_uri)
    store = shlex.quote(f"sqlite:///{database}" if database is not None else tracking_uri)  # from any directory
    load = f'import mlflow; model = mlflow.pyfunc.load_model("{model_uri}")'
    python = shlex.quote(str(tools / "python")) if tools else "python"
    # The server runs the environment's own programs (uvicorn), found on the PATH.
    path = f"PATH={shlex.quote(str(tools))}:$PATH " if tools else ""
    lines.append(f"load it: {TRACKING_URI_VARIABLE}={store} {python} -c {shlex.quote(load)}")
    lines.append(
        f"serve it: {path}{TRACKING_URI_VARIABLE}={store} mlflow models serve -m {model_uri} --env-manager local"
    )
    return lines


def rows_table(rows: Sequence[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for column in rows[0] if rows else {}:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(_cell(value) for value in row.values()))
    return table


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else (f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}")
    return "-" if value is None else str(value)


def sweep_description(
    standings: Standings, *, sweep_name: str, test_scores: Mapping[str, float] = {}, rerun_command: str | None = None
) -> str:
    """The parent run's description, in Markdown: the leaderboard (the params that vary) with
    how many trials are tied with the best, the NaN table (batch size x clipping), the refit's
    test scores and how to rerun the best trial."""
    records, objective, ordered = standings.records, standings.objective, standings.ranked
    varying, shared = split_params(records)
    better = "higher" if objective.mode == "max" else "lower"
    lines = [f"## {sweep_name}: {len(records)} trials, ranked by {objective.key} ({better} is better)", ""]
    if standings.ties_line():
        lines += [standings.ties_line()[0].upper() + standings.ties_line()[1:] + ".", ""]
    lines += [
        "| rank | trial | " + f"{objective.key} ± std | epoch | vs best | status | " + " | ".join(varying) + " |",
        "|" + " --- |" * (6 + len(varying)),
    ]
    rows = []
    for record in [*ordered, *(r for r in records if r not in ordered)]:
        rank = str(standings.rank(record)) if record in ordered else "-"
        score = _score_text(record, objective) if record in ordered else "-"
        cells = [
            rank,
            f"{record.label} ({short_run_id(record.run_id)})",
            score,
            _epoch_text(record) if record in ordered else "-",
            standings.versus_best(record),
            status_text(record),
            *(_short(record.params.get(name, "-")) for name in varying),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    # MLflow keeps at most 8,000 characters of a tag: the best rows fit, the rest is in cv_results.csv.
    budget = DESCRIPTION_BUDGET - 2000  # room for the NaN table, refit and rerun sections
    shown = 0
    while shown < len(rows) and sum(len(row) + 1 for row in rows[: shown + 1]) < budget:
        shown += 1
    lines += rows[:shown]
    if shown < len(rows):
        more = ["…", f"{len(rows) - shown} more trials in `cv_results.csv`", *[""] * (4 + len(varying))]
        lines.append("| " + " | ".join(more) + " |")
    if shared:
        lines += ["", "All trials: " + ", ".join(f"`{key}={_short(value)}`" for key, value in sorted(shared.items()))]
    nan_rows = nan_table_rows(records)
    lines += [
        "",
        "### NaN failures by batch size and clipping",
        "",
        "| batch_size | clipping | trials | NaN |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {row['batch_size']} | {row['clipping']} | {row['trials']} | {row['nan']} |" for row in nan_rows]
    if test_scores:
        lines += [
            "",
            "### Refit of the best trial on the held-out test split",
            "",
            ", ".join(f"{key} **{value:.4f}**" for key, value in sorted(test_scores.items())),
        ]
    if rerun_command:
        lines += ["", "### Rerun the best trial", "", f"```\n{rerun_command}\n```"]
    return ("\n".join(lines) + "\n")[:DESCRIPTION_BUDGET]


def trial_description(record: TrialRecord, standings: Standings) -> str:
    """A trial run's description: its rank among the sweep's trials, the epoch it is scored at,
    how it compares with the best, and its status."""
    rank = standings.rank(record)
    if rank is None:
        return f"Not ranked: status {status_text(record)}."
    versus = standings.versus_best(record)
    comparison = (
        ""
        if versus == "-"
        else (
            " The best trial."
            if rank == 1
            else f" Against the best on the same {standings.replicas} replicas: {versus}."
        )
    )
    return (
        f"Rank **{rank}** of {len(standings.ranked)} ranked trials: {standings.objective.key} "
        f"{_score_text(record, standings.objective)} at epoch {_epoch_text(record)}; status {record.status}."
        + comparison
    )
