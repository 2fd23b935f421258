"""The benchmarks read what foldsweep records and prints through the package's own names: each
reader against a real record (the shared recorded sweep) or the package's own printed line, so
that a renamed tag, metric or printed field breaks a test, not a benchmark's numbers."""

from __future__ import annotations

import pytest

from pipeline.contract.account import TimeAccount
from pipeline.contract.results import COMPILE_S, SETUP_S, TRAIN_S, WORKER_PID, WORKER_RSS
from pipeline.inputs.spec import Objective
from pipeline.records.report import account_text
from pipeline.records.tracking import Tag

pytestmark = pytest.mark.e2e


def test_compile_cache_totals_the_recorded_trials_compile_time_and_each_folds_losses(recorded_sweep):
    from benchmarks.compile_cache import trial_totals

    _, sweep, trials = recorded_sweep.records()
    measured = [record for record in trials if COMPILE_S in record.metrics]
    assert measured, "the recorded sweep's trials measured their compile time"

    totals = trial_totals(recorded_sweep.uri)

    assert totals["trials"] == len(measured)
    assert totals["compile_s"] == round(sum(record.metrics[COMPILE_S] for record in measured), 1)
    (losses, *_) = totals["fold_losses"].values()
    assert {"split0_train_loss", "split0_val_loss"} <= set(losses)
    assert all(len(curve) >= 1 for curve in losses.values())


def test_soak_reads_each_trials_worker_from_its_record(recorded_sweep):
    from benchmarks.soak import worker_sample

    _, _, trials = recorded_sweep.records()
    for record in trials:
        pid, trials_run, rss, _ = worker_sample(record)
        assert pid == record.tags[Tag.of(WORKER_PID)] and int(pid) > 0
        assert trials_run >= 1 and rss == record.metrics[WORKER_RSS] > 0


def test_compile_cost_and_trial_vs_fit_read_the_time_account_foldsweep_trial_prints():
    from benchmarks.compile_cost import seconds
    from benchmarks.trial_vs_fit import summary

    account = TimeAccount.of(12.5, **{SETUP_S: 2.25, COMPILE_S: 4.75, TRAIN_S: 5.0})
    printed = "\n".join(
        [
            "trial of spec.yaml: batch_size=32",
            "fused: 3 folds in one execution, side by side (2 compute threads); steps per launch: 1",
            f"epoch 1: fold 0 train_loss 1.0 val_loss 1.0 val_accuracy 0.5 | {Objective(metric='accuracy').key} 0.5000",
            f"where the time went: {account_text(account)}",
        ]
    )

    assert seconds(COMPILE_S, printed) == 4.75 and seconds(TRAIN_S, printed) == 5.0
    assert summary(20.0, printed) == {
        "s": 20.0,
        "compile_s": 4.75,
        "plan": "3 folds in one execution, side by side (2 compute threads)",
        "cv": 0.5,
    }
