"""Typed results and their one flattening: Ray Tune's report, read back on the driver, and what
MLflow records of it. Every key a trial reports is recorded or declared bookkeeping."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import pytest
from helpers import MNIST1D_EXPERIMENT

from pipeline.contract.account import TimeAccount
from pipeline.contract.plan import TrialPlan
from pipeline.contract.results import (
    BOOKKEEPING_KEYS,
    FOLD_SCORE_NAMES,
    NAN_FOLD_SCORES,
    WORKER_RETIRES,
    EpochResult,
    FoldScores,
    FoldThroughput,
    NanEvent,
    NanReport,
    Throughput,
    TrialInfo,
    TrialStatus,
    is_bookkeeping,
    placement_metrics,
    placement_tags,
    trial_account,
)
from pipeline.engine.recipe import TrainingRecipe
from pipeline.engine.resident import resident_data
from pipeline.engine.runner import TrialRunner, TrialSettings, Worker
from pipeline.inputs.datasets import load_dataset
from pipeline.inputs.folds import make_folds
from pipeline.inputs.hypermodel import load_builder
from pipeline.inputs.spec import CVSpec, DatasetSpec, TrainSpec
from pipeline.records.tracking import Tag

ACCOUNT = TimeAccount.of(20.0, setup_s=5.0, compile_s=3.0, train_s=8.0, eval_s=1.5, gap_s=2.0)


def epoch_result(*, epoch=2, planned=3, nan=NanReport(), account=None, gap=None) -> EpochResult:
    return EpochResult(
        epoch=epoch,
        fold_ids=(0, 2),
        folds=(FoldScores(0.5, 0.6, 0.7), FoldScores(0.4, 0.5, 0.9)),
        throughput=Throughput(100.0, 200.0, 3.0, (FoldThroughput(50.0, 1.0), FoldThroughput(60.0, math.nan))),
        nan=nan,
        epochs_planned=planned,
        account=account,
        epoch_gap_s=gap,
    )


def recorded_keys(report: Mapping[str, Any]) -> set[str]:
    """The keys of a report that MLflow records (as metrics, tags or artifacts), including a
    throughput not yet measurable, which is left out only while it is NaN."""
    result = EpochResult.from_report(report)
    info = TrialInfo.from_report(report)
    # the info's fields as reported: recorded as tags, params, metrics and artifacts
    from_info = set(info.report()) if info is not None else set()
    # the account: recorded when the trial ends, from its last report
    return {
        *result.mlflow_metrics(),
        *result.throughput_values(),
        *result.mlflow_tags(),
        *placement_tags(report),
        *placement_metrics(report),
        *result.account_values(),
        *from_info,
    }


def unrecorded_keys(report: Mapping[str, Any]) -> set[str]:
    """Keys of a report that neither reach MLflow nor are declared bookkeeping: what would be
    silently dropped (none may be)."""
    # Before a retirement reason (a worker that runs on, or a checkpoint of an older release's
    # yes/no), the key holds nothing to record.
    quiet = {WORKER_RETIRES} if not isinstance(report.get(WORKER_RETIRES), str) or not report[WORKER_RETIRES] else set()
    return {key for key in set(report) - recorded_keys(report) - quiet if not is_bookkeeping(key)}


def test_a_report_reads_back_as_the_same_result():
    nan = NanReport(1, 2, NanEvent(epoch=1, step=4, last_finite_loss=0.3, grad_norm=7.0))
    for result in (epoch_result(), epoch_result(nan=nan), epoch_result(account=ACCOUNT, gap=0.25)):
        again = EpochResult.from_report(json.loads(json.dumps(result.report())))
        assert json.dumps(again.report()) == json.dumps(result.report())  # NaN != NaN, so compared as text
        assert again.nan == result.nan and again.folds == result.folds


def test_a_time_account_leaves_the_unmeasured_rest_to_other_s_and_reads_back_from_a_report():
    assert ACCOUNT.other_s == pytest.approx(0.5)
    assert sum(ACCOUNT.as_dict().values()) == pytest.approx(ACCOUNT.wall_s)
    assert ACCOUNT.shares() == pytest.approx(
        {"setup_s": 0.25, "compile_s": 0.15, "train_s": 0.4, "eval_s": 0.075, "gap_s": 0.1, "other_s": 0.025}
    )
    report = epoch_result(account=ACCOUNT, gap=0.25).report()
    # Its compile_s is the throughput's (3.0 here), reported once.
    assert {
        key: report[key]
        for key in ("trial_wall_s", "setup_s", "train_s", "eval_s", "gap_s", "other_s", "epoch_gap_s", "compile_s")
    } == pytest.approx(
        {
            "trial_wall_s": 20.0,
            "setup_s": 5.0,
            "train_s": 8.0,
            "eval_s": 1.5,
            "gap_s": 2.0,
            "other_s": 0.5,
            "epoch_gap_s": 0.25,
            "compile_s": 3.0,
        }
    )
    assert trial_account(report) == ACCOUNT
    # Before a second epoch compiling is not told apart (NaN): none of the wall clock is put on it.
    unmeasured = {**report, "compile_s": math.nan, "other_s": 3.5}
    assert trial_account(unmeasured).as_dict()["compile_s"] == 0.0
    assert trial_account(unmeasured).other_s == pytest.approx(3.5)
    assert trial_account({"trial_wall_s": 9.0, "compile_s": 1.0}) is None  # recorded before accounts were kept
    # The gap is a finding per epoch; the account is recorded once, when the trial ends.
    metrics = epoch_result(account=ACCOUNT, gap=0.25).mlflow_metrics()
    assert metrics["epoch_gap_s"] == 0.25 and "setup_s" not in metrics and "trial_wall_s" not in metrics
    assert "epoch_gap_s" not in epoch_result(account=ACCOUNT).report()


def test_the_report_speaks_scikit_learns_vocabulary():
    report = epoch_result().report()
    assert report["split2_val_accuracy"] == 0.9 and report["mean_val_accuracy"] == pytest.approx(0.8)
    assert report["std_val_accuracy"] == pytest.approx(0.1)
    assert report["split0_train_samples_per_s"] == 50.0 and report["train_samples_per_s"] == 100.0


def test_mlflow_gets_nan_scores_but_no_unmeasured_throughput():
    nan = NanReport(1, 2, NanEvent(epoch=1, step=4, last_finite_loss=0.3, grad_norm=7.0))
    frozen = EpochResult(
        epoch=2,
        fold_ids=(0, 2),
        folds=(FoldScores(0.5, 0.6, 0.7), FoldScores.frozen()),
        throughput=epoch_result().throughput,
        nan=nan,
    )
    metrics = frozen.mlflow_metrics()
    assert math.isnan(metrics["split2_val_loss"]) and metrics["mean_val_loss"] == pytest.approx((0.6 + 1e6) / 2)
    assert "split2_compile_s" not in metrics and metrics["split0_compile_s"] == 1.0
    assert frozen.mlflow_tags() == {
        "nan_fold": "2",
        "nan_epoch": "1",
        "nan_step": "4",
        "nan_last_finite_loss": "0.3",
        "nan_grad_norm": "7.0",
    }


def test_every_metric_of_a_fold_is_reported_read_back_and_a_nan_fold_counts_as_its_worst():
    """Compiled metrics ride along as val_<name>; a regression has no accuracy; a NaN fold counts
    as each metric's worst by its direction (unknown: the mean stays NaN), on the driver too."""
    folds = (
        FoldScores(0.5, 0.6, None, {"mae": 0.2, "r2_score": 0.7, "mcc": 0.3}),
        FoldScores.frozen(("mae", "r2_score", "mcc"), classifier=False),
    )
    result = EpochResult(
        epoch=1,
        fold_ids=(0, 1),
        folds=folds,
        throughput=epoch_result().throughput,
        directions={"mae": "min", "r2_score": "max", "mcc": ""},
    )
    report = json.loads(json.dumps(result.report()))
    assert "split0_val_accuracy" not in report and report["split0_val_mae"] == 0.2
    assert report["mean_val_mae"] == pytest.approx((0.2 + 1e6) / 2)
    assert report["mean_val_r2_score"] == pytest.approx((0.7 - 1e6) / 2)
    assert math.isnan(report["mean_val_mcc"])
    again = EpochResult.from_report(report)
    assert again.folds[0] == folds[0] and again.cv_summary()["mean_val_mae"] == report["mean_val_mae"]
    assert not unrecorded_keys({**report, "running_best_mean_val_mae": 0.2})


def test_the_fold_scores_are_named_once():
    """A fold's own scores are ``FoldScores``' fields: reported under those names, read back from
    them, and each counted as its worst for a NaN fold."""
    scores = FoldScores(0.5, 0.6, 0.7)
    assert tuple(scores.as_dict()) == FOLD_SCORE_NAMES == tuple(NAN_FOLD_SCORES)
    assert NAN_FOLD_SCORES == {"train_loss": 1e6, "val_loss": 1e6, "val_accuracy": 0.0}
    result = EpochResult(epoch=1, fold_ids=(0,), folds=(scores,), throughput=epoch_result().throughput)
    assert EpochResult.from_report(result.report()).folds == (scores,)


def test_status_follows_nan_and_planned_epochs():
    assert epoch_result(epoch=3, planned=3).status() is TrialStatus.OK
    assert epoch_result(epoch=2, planned=3).status() is TrialStatus.PRUNED
    nan = NanReport(1, 0, NanEvent(epoch=1, step=0, last_finite_loss=0.3, grad_norm=7.0))
    assert epoch_result(nan=nan).status() is TrialStatus.NAN
    assert [status.run_state for status in TrialStatus] == [
        "RUNNING",
        "FINISHED",
        "FINISHED",
        "FAILED",
        "FAILED",
        "KILLED",
    ]


@pytest.mark.training
def test_every_key_a_trial_reports_is_recorded_or_bookkeeping():
    dataset = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 200}))
    folds = make_folds(CVSpec(n_splits=2), dataset).folds
    settings = TrialSettings(
        experiment_path=str(MNIST1D_EXPERIMENT),
        experiment_attr="build",
        dataset_fingerprint=dataset.fingerprint,
        recipe=TrainingRecipe(TrainSpec(epochs=2)),
    )
    # In this process TensorFlow already runs: the worker without configuring its threads.
    worker = Worker(
        data=resident_data(dataset.fingerprint, dataset.x, dataset.y),
        build_fn=load_builder(MNIST1D_EXPERIMENT, "build"),
        device_notice="",
    )
    runner = TrialRunner(
        {"conv_layers": 1, "filters": 8, "kernel_size": 3, "dropout": 0.0, "batch_size": 32},
        worker=worker,
        folds=folds,
        settings=settings,
    )
    first, second = runner.step(), runner.step()
    assert "trial_plan" in first and "trial_plan" not in second  # once per process
    assert TrialPlan.from_dict(json.loads(first["trial_plan"])) == runner.trainer.plan
    assert second["done"] and not first["done"]
    for report in (first, second):
        assert unrecorded_keys(report) == set()
    # What nobody declared is caught, not dropped in silence.
    assert unrecorded_keys({**second, "mystery_score": 1.0}) == {"mystery_score"}
    assert not recorded_keys(second) & BOOKKEEPING_KEYS


@pytest.mark.e2e
def test_what_ray_tune_delivers_reaches_mlflow(recorded_sweep):
    """Through the session's recorded sweep: every result Ray Tune hands the driver (with the keys
    Ray adds), the NaN trial's too, is recorded or bookkeeping, and what is recorded is in its
    trial's run."""
    delivered = recorded_sweep.delivered
    tracker, _, trials = recorded_sweep.records()
    runs = {run.tags[Tag.TRIAL_ID]: run for run in trials}
    for trial_id in runs:  # the NaN trial's other fold trains on: it reports every epoch too
        assert [report["epoch"] for report in delivered if report["trial_id"] == trial_id] == [1, 2]
    assert len(delivered) == 2 * len(runs)
    for report in delivered:
        assert unrecorded_keys(report) == set(), f"keys nobody records: {unrecorded_keys(report)}"
    for trial_id, run in runs.items():
        reports = [report for report in delivered if report["trial_id"] == trial_id]
        assert {"pid", "node_ip", "hostname", "tf_threads", "fused_reason"} <= recorded_keys(reports[0])
        for report in reports:
            for key in recorded_keys(report) - {"params_in_effect"}:
                if isinstance(report[key], float) and math.isnan(report[key]) and key.endswith("_s"):
                    continue  # a time not measured (yet: compiling is told apart after a second epoch)
                assert key in run.metrics or Tag.of(key) in run.tags or key in ("model_summary", "trial_plan"), key
        assert set(reports[0]["params_in_effect"]) <= set(run.params)  # the optimizer and its learning rate
        artifacts = set(tracker.artifact_paths(run.run_id))
        assert {"model_summary.txt", "trial_plan.json", "history.csv", "trial_config.json"} <= artifacts
