"""A sweep's record on its MLflow runs once its trials have ended: ``cv_results.csv``,
``nan_summary.csv`` and the plots on the parent run, and the descriptions (what the MLflow UI
shows as a run's description) of the parent run and of every trial. ``foldsweep report``
reads a recorded sweep (``report_sweep``) and refreshes all of it."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pipeline.base.environment import recorded_environment
from pipeline.base.errors import TrackingError
from pipeline.contract.account import TimeAccount
from pipeline.contract.results import recorded_sweep_account
from pipeline.inputs.spec import Objective
from pipeline.records.plots import write_plots
from pipeline.records.report import (
    Standings,
    cv_results,
    nan_table_rows,
    rerun_command,
    split_params,
    sweep_description,
    to_csv,
    trial_description,
)
from pipeline.records.tracking import DESCRIPTION_TAG, SweepRecord, Tag, Tracker, TrialRecord


@dataclass(frozen=True)
class SweepReport:
    """A recorded sweep as ``foldsweep report`` shows it: its parent run, its trials ranked, the
    refit's scores on the held-out test split, and where the sweep's wall clock went (None for a
    sweep recorded before it was kept)."""

    tracker: Tracker
    parent: SweepRecord
    records: list[TrialRecord]
    standings: Standings
    test_scores: dict[str, float]
    account: TimeAccount | None

    @property
    def environment(self) -> list[str]:
        """The environment the sweep ran in, as its tags say (``recorded_environment``)."""
        return recorded_environment(self.parent.tags)

    def publish(self) -> str:
        """Refresh what the sweep leaves on its runs (``publish``); returns the UI address path
        that opens its trials."""
        return publish(
            self.tracker,
            self.parent.run_id,
            self.standings,
            sweep_name=self.parent.name,
            test_scores=self.test_scores,
        )


def report_sweep(tracking_uri: str, sweep: str | None = None) -> SweepReport:
    """The recorded sweep ``sweep`` (a name or parent run id; None: the latest) of a store that
    exists.

    Raises:
        TrackingError: no store at ``tracking_uri``, or no such sweep in it.
        PrivateHookMissing: the installed MLflow lacks what foldsweep reaches into.
    """
    from pipeline.base.private_hooks import require_hooks
    from pipeline.records.stores import require_existing_store

    require_existing_store(tracking_uri)
    require_hooks(["mlflow"])
    tracker = Tracker(tracking_uri)
    parent = tracker.find_sweep(sweep)
    missing = tracker.missing_artifacts(parent.run_id)
    if missing is not None:  # its tables and plots would be written there, the folder made anew
        raise TrackingError(f"SWEEP: {missing}")
    records = tracker.trial_records(parent.run_id)
    return SweepReport(
        tracker,
        parent,
        records,
        Standings.of(records, parent.objective, n_splits=parent.n_splits),
        test_scores={key: value for key, value in parent.metrics.items() if key.startswith("test_")},
        account=recorded_sweep_account(parent.metrics),
    )


def draw_plots(tracker: Tracker, records: Sequence[TrialRecord], objective: Objective, directory: Path) -> list[Path]:
    """The sweep's plots of its trials ``records``, drawn into ``directory`` (``write_plots``)
    with each trial's ``objective`` per epoch as recorded; returns their paths."""
    histories = tracker.metric_histories([record.run_id for record in records], objective.key)
    return write_plots(records, objective, directory, histories)


def draw_plots_beside(
    tracker: Tracker, records: Sequence[TrialRecord], objective: Objective, directory: Path
) -> Future[list[Path]]:
    """``draw_plots`` in a thread of its own, started now: a sweep's driver draws its plots, the
    largest part of publishing, while its refit ends (on a core the last trial left idle). The
    future holds their paths, or what failed."""
    beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sweep-plots")
    try:
        return beside.submit(draw_plots, tracker, records, objective, directory)
    finally:
        beside.shutdown(wait=False)


def publish(
    tracker: Tracker,
    parent_run_id: str,
    standings: Standings,
    *,
    sweep_name: str,
    test_scores: Mapping[str, float] = {},
    drawn: Future[list[Path]] | None = None,
) -> str:
    """Write (or refresh) the sweep's tables, plots, run descriptions, each ranked trial's
    ``pvalue_vs_best`` and its view in the MLflow UI; returns the UI address path that opens the
    sweep's trials. ``drawn``: the plots of the same trials, drawn beforehand
    (``draw_plots_beside``), else they are drawn here."""
    records, objective = standings.records, standings.objective
    texts = {"cv_results.csv": to_csv(cv_results(standings)), "nan_summary.csv": to_csv(nan_table_rows(records))}
    with contextlib.ExitStack() as drawing:
        if drawn is not None:
            plots = drawn.result()
        else:
            directory = Path(drawing.enter_context(tempfile.TemporaryDirectory()))
            plots = draw_plots(tracker, records, objective, directory)
        tracker.publish_sweep_files(parent_run_id, texts=texts, files={path: "plots" for path in plots})
    descriptions = {record.run_id: trial_description(record, standings) for record in records}
    descriptions[parent_run_id] = sweep_description(
        standings, sweep_name=sweep_name, test_scores=test_scores, rerun_command=rerun_command(standings, tracker.uri)
    )
    # Each ranked trial's p-value against the best is a tag: it changes when a resumed sweep finds
    # a new best, and a tag is replaced where a metric would grow a history.
    tags = {run_id: {DESCRIPTION_TAG: text} for run_id, text in descriptions.items()}
    for run_id, comparison in standings.comparisons.items():
        tags.setdefault(run_id, {})[Tag.PVALUE_VS_BEST] = f"{comparison.pvalue:.4g}"
    tracker.tag_runs(tags)
    return share_view(tracker, parent_run_id, records, objective)


def share_view(tracker: Tracker, parent_run_id: str, records: Sequence[TrialRecord], objective: Objective) -> str:
    """The sweep's shared view in the MLflow UI over its trials ``records``: the params they vary
    as columns, their metrics in the chart view; returns the UI address path that opens it."""
    varying, _ = split_params(records)
    metric_keys = {key for record in records for key in record.metrics}
    return tracker.share_sweep_view(parent_run_id, objective=objective, columns=varying, metric_keys=metric_keys)
