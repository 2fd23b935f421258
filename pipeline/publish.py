"""A sweep's record on its MLflow runs once its trials have ended: ``cv_results.csv``,
``nan_summary.csv`` and the plots on the parent run, and the descriptions (what the MLflow UI
shows as a run's description) of the parent run and of every trial. ``foldsweep report``
refreshes all of it."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from pipeline.plots import write_plots
from pipeline.report import cv_results, nan_table_rows, split_params, sweep_description, to_csv, trial_description
from pipeline.spec import Objective
from pipeline.tracking import Tracker, TrialRecord


def publish(tracker: Tracker, parent_run_id: str, records: Sequence[TrialRecord], objective: Objective, *,
            sweep_name: str, test_scores: Mapping[str, float] = {}) -> str:
    """Write (or refresh) the sweep's tables, plots, run descriptions and its view in the MLflow
    UI; returns the UI address path that opens the sweep's trials."""
    texts = {"cv_results.csv": to_csv(cv_results(records)), "nan_summary.csv": to_csv(nan_table_rows(records))}
    histories = tracker.metric_histories([record.run_id for record in records], objective.key)
    with tempfile.TemporaryDirectory() as directory:
        plots = write_plots(records, objective, Path(directory), histories)
        tracker.publish_sweep_files(parent_run_id, texts=texts, files={path: "plots" for path in plots})
    descriptions = {record.run_id: trial_description(record, records, objective) for record in records}
    descriptions[parent_run_id] = sweep_description(records, objective, sweep_name=sweep_name, test_scores=test_scores,
                                                    rerun_command=_rerun_command(records, objective, tracker.uri))
    tracker.describe_runs(descriptions)
    varying, _ = split_params(records)
    return tracker.share_sweep_view(parent_run_id, objective=objective, columns=varying)


def _rerun_command(records: Sequence[TrialRecord], objective: Objective, uri: str) -> str | None:
    from pipeline.report import ranked

    ranking = ranked(records, objective)
    return f"foldsweep rerun {ranking[0].run_id} --tracking-uri {uri}" if ranking else None
