"""Summaries of recorded trials (pipeline.records.report): which trials are ranked and how,
scikit-learn's cv_results rows, the NaN, throughput and time tables, the rerun command and the
run descriptions, from ``TrialRecord``s as MLflow holds them. (The comparisons with the best
are test_significance's.)"""

from __future__ import annotations

import math

import pytest

from pipeline.contract.results import TrialStatus
from pipeline.inputs.spec import Objective
from pipeline.records.report import (
    Standings,
    account_rows,
    compile_share_text,
    cv_results,
    nan_table_rows,
    param_names,
    ranked,
    recorded_metrics,
    replica_scores,
    rerun_command,
    selected_epoch,
    selected_score,
    shared_ranks,
    split_params,
    status_text,
    sweep_description,
    throughput_rows,
    to_csv,
    trial_description,
    trial_line,
)
from pipeline.records.tracking import Tag, TrialRecord

ACCURACY = Objective(metric="accuracy", mode="max")
LOSS = Objective(metric="loss", mode="min")


def nan_at(fold: int, epoch: int, step: int) -> dict[str, str]:
    """The tags of a trial that went NaN in ``fold`` at ``epoch``, ``step``."""
    return {Tag.of("nan_fold"): str(fold), Tag.of("nan_epoch"): str(epoch), Tag.of("nan_step"): str(step)}


def record(
    number: int,
    accuracy: float | None = None,
    *,
    status=TrialStatus.OK,
    epoch: int | None = 2,
    params=None,
    tags=None,
    **metrics: float,
) -> TrialRecord:
    """A trial scored ``accuracy`` at its selected epoch ``epoch`` (on two replicas, 0.02 apart)."""
    scores = {}
    if accuracy is not None:
        scores = {
            "selected_mean_val_accuracy": accuracy,
            "selected_std_val_accuracy": 0.01,
            "selected_split0_val_accuracy": accuracy - 0.01,
            "selected_split1_val_accuracy": accuracy + 0.01,
            "mean_val_accuracy": accuracy - 0.1,
            "best_epoch": float(epoch),
        }
    return TrialRecord(
        run_id=f"{number:08x}{0:024x}",
        run_name=f"trial-{number}",
        trial_id=f"abc_{number:05d}",
        state=status.run_state,
        status=status,
        params=params or {"batch_size": "8", "learning_rate": str(0.01 * number)},
        metrics={**scores, **metrics},
        tags=tags or {},
    )


def test_a_trials_score_is_the_one_at_its_selected_epoch_or_its_last_without_a_selection():
    scored = record(1, 0.8)
    assert selected_score(scored, "mean_val_accuracy") == 0.8 and selected_epoch(scored) == 2
    old = record(2, mean_val_accuracy=0.7)  # recorded before trials were scored at a selected epoch
    assert selected_score(old, "mean_val_accuracy") == 0.7 and selected_epoch(old) is None
    assert selected_score(record(3, math.nan), "mean_val_accuracy") is None
    assert replica_scores(scored, ACCURACY) == pytest.approx([0.79, 0.81])


def test_only_trials_that_finished_with_a_finite_score_are_ranked_best_first_ties_in_start_order():
    trials = [
        record(1, 0.7),
        record(2, 0.9),
        record(3, 0.7),
        record(4, 0.95, status=TrialStatus.PRUNED),
        record(5, math.nan),
        record(6, status=TrialStatus.NAN),
    ]
    assert [trial.trial_id for trial in ranked(trials, ACCURACY)] == ["abc_00002", "abc_00001", "abc_00003"]
    assert shared_ranks(trials, ACCURACY) == {trials[1].run_id: 1, trials[0].run_id: 2, trials[2].run_id: 2}
    losses = [record(1, mean_val_loss=0.5), record(2, mean_val_loss=0.3)]
    assert [trial.trial_id for trial in ranked(losses, LOSS)] == ["abc_00002", "abc_00001"]


def test_a_nan_trial_says_where_it_went_nan():
    nan = record(1, status=TrialStatus.NAN, tags=nan_at(1, 3, 17))
    assert status_text(nan) == "nan (fold 1, epoch 3, step 17)"
    assert status_text(record(2, 0.5)) == "ok"
    running = TrialRecord(
        run_id="f" * 32, run_name="r", trial_id="", state="RUNNING", status=None, params={}, metrics={}
    )
    assert status_text(running) == "running" and running.label == "r"


def test_a_trial_is_printed_with_its_score_at_its_selected_epoch_or_why_it_has_none():
    assert trial_line(record(1, 0.8123), "mean_val_accuracy") == (
        "  trial-00001 (00000001): ok (mean_val_accuracy 0.8123 at epoch 2)"
    )
    # a NaN trial's mean counts its NaN folds as the worst score: it is no score to show
    nan = record(2, 0.1, status=TrialStatus.NAN, tags=nan_at(0, 1, 4))
    assert trial_line(nan, "mean_val_accuracy") == "  trial-00002 (00000002): nan (fold 0, epoch 1, step 4)"
    failed = TrialRecord(
        run_id="f" * 32,
        run_name="trial-3",
        trial_id="",
        state="FAILED",
        status=TrialStatus.ERROR,
        params={},
        metrics={},
        error="Traceback (most recent call last):\n  ...\nValueError: no such layer\n",
    )
    assert trial_line(failed, "mean_val_accuracy") == "  trial-3 (ffffffff): error - ValueError: no such layer"


def test_a_param_in_effect_that_repeats_the_hypermodels_own_is_one_column():
    fed = [
        TrialRecord(
            run_id=str(k),
            run_name="",
            trial_id="",
            state="FINISHED",
            status=TrialStatus.OK,
            params={"lr": lr, "learning_rate": lr, "optimizer": "adam", "units": "32"},
            metrics={},
        )
        for k, lr in enumerate(("0.01", "0.1"))
    ]
    assert param_names(fed) == ["lr", "optimizer", "units"]
    assert split_params(fed) == (["lr"], {"optimizer": "adam", "units": "32"})


def test_cv_results_has_scikit_learns_columns_for_each_trial():
    trials = [
        record(1, 0.7, train_samples_per_s=1000.0, nan_failures=0.0),
        record(2, 0.9, nan_failures=0.0),
        record(3, status=TrialStatus.NAN, tags=nan_at(0, 1, 4), nan_failures=1.0),
    ]
    rows = cv_results(Standings.of(trials, ACCURACY, n_splits=None))
    assert [row["trial_id"] for row in rows] == ["abc_00001", "abc_00002", "abc_00003"]
    first = rows[0]
    assert (first["param_batch_size"], first["param_learning_rate"], first["best_epoch"]) == ("8", "0.01", 2)
    assert (first["split0_val_accuracy"], first["split1_val_accuracy"]) == pytest.approx((0.69, 0.71))
    assert (first["mean_val_accuracy"], first["std_val_accuracy"], first["rank_val_accuracy"]) == (0.7, 0.01, 2)
    assert first["train_samples_per_s"] == 1000.0 and first["pvalue_vs_best"] == ""  # no comparisons: no n_splits
    assert rows[1]["rank_val_accuracy"] == 1 and rows[1]["train_samples_per_s"] == ""
    nan = rows[2]
    assert (nan["status"], nan["rank_val_accuracy"], nan["mean_val_accuracy"], nan["best_epoch"]) == (
        TrialStatus.NAN,
        "",
        "",
        "",
    )
    assert (nan["nan_failures"], nan["nan_fold"], nan["nan_epoch"], nan["nan_step"]) == (1.0, "0", "1", "4")
    text = to_csv(rows).splitlines()
    assert text[0].startswith("run_id,trial_id,status,best_epoch,param_batch_size,param_learning_rate,")
    assert len(text) == 4 and to_csv([]) == ""


def test_loss_and_accuracy_come_first_among_the_recorded_metrics():
    trials = [record(1, 0.7, mean_val_loss=0.4, selected_mean_val_auc=0.8)]
    assert recorded_metrics(trials, Objective(metric="auc", mode="max")) == ["accuracy", "loss", "auc"]
    assert recorded_metrics(trials, ACCURACY) == ["accuracy", "loss", "auc"]


def test_the_nan_table_counts_trials_and_nan_folds_per_batch_size_and_clipping():
    trials = [
        record(1, 0.7, params={"batch_size": "8", "clipping": "none"}, nan_failures=0.0),
        record(2, status=TrialStatus.NAN, params={"batch_size": "8", "clipping": "none"}, nan_failures=2.0),
        record(3, 0.8, params={"batch_size": "32"}),
        record(4, 0.8, params={"batch_size": "8", "clipping": "norm"}),
    ]
    assert nan_table_rows(trials) == [
        {"batch_size": 8, "clipping": "none", "trials": 2, "nan": 1, "nan_folds": 2},
        {"batch_size": 8, "clipping": "norm", "trials": 1, "nan": 0, "nan_folds": 0},
        {"batch_size": 32, "clipping": "none", "trials": 1, "nan": 0, "nan_folds": 0},
    ]


def test_throughput_is_the_median_per_batch_size_of_the_finite_values():
    trials = [
        record(
            k,
            0.7,
            params={"batch_size": batch},
            train_samples_per_s=rate,
            eval_samples_per_s=2 * rate,
            compile_s=compile_s,
            trial_wall_s=10.0,
        )
        for k, (batch, rate, compile_s) in enumerate(
            [("8", 100.0, 1.0), ("8", 300.0, math.nan), ("8", 200.0, 3.0), ("16", 50.0, 2.0)]
        )
    ]
    assert throughput_rows([*trials, record(9, 0.7)]) == [
        {
            "batch_size": 8,
            "trials": 3,
            "train_samples_per_s": 200.0,
            "eval_samples_per_s": 400.0,
            "compile_s": 2.0,
            "trial_wall_s": 10.0,
        },
        {
            "batch_size": 16,
            "trials": 1,
            "train_samples_per_s": 50.0,
            "eval_samples_per_s": 100.0,
            "compile_s": 2.0,
            "trial_wall_s": 10.0,
        },
    ]


def test_the_time_account_is_per_trial_then_summed():
    parts = {"setup_s": 2.0, "compile_s": 3.0, "train_s": 4.0, "eval_s": 1.0}
    trials = [
        record(1, 0.7, trial_wall_s=10.0, **parts),
        record(2, 0.8, trial_wall_s=20.0, **parts),
        record(3, 0.8, trial_wall_s=5.0),
    ]  # recorded before accounts were kept
    rows = account_rows(trials)
    assert [row["trial"] for row in rows] == ["trial-00001", "trial-00002", "all 2"]
    assert [row["trial_wall_s"] for row in rows] == [10.0, 20.0, 30.0]
    assert rows[0]["setup_s"] == "2.00\n20%" and rows[2]["train_s"] == "8.00\n27%"
    assert account_rows([record(3, 0.8)]) == []


def test_the_rerun_command_names_the_best_trial_and_the_store_by_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    standings = Standings.of([record(1, 0.7), record(2, 0.9)], ACCURACY, n_splits=None)
    assert rerun_command(standings, "sqlite:///mlflow.db") == (
        f"foldsweep rerun 00000002 --tracking-uri sqlite:///{(tmp_path / 'mlflow.db').resolve()}"
    )
    assert rerun_command(standings, "http://localhost:5000", program="fs") == (
        "fs rerun 00000002 --tracking-uri http://localhost:5000"
    )
    assert rerun_command(Standings.of([record(3, status=TrialStatus.NAN)], ACCURACY, n_splits=None), "x") is None


def test_the_descriptions_rank_the_trials_and_say_how_to_rerun_the_best():
    trials = [
        record(1, 0.7),
        record(2, 0.9),
        record(3, status=TrialStatus.NAN, tags=nan_at(0, 1, 4)),
    ]
    standings = Standings.of(trials, ACCURACY, n_splits=None)
    text = sweep_description(
        standings, sweep_name="tiny", test_scores={"test_accuracy": 0.875}, rerun_command="foldsweep rerun 00000002"
    )
    lines = text.splitlines()
    assert lines[0] == "## tiny: 3 trials, ranked by mean_val_accuracy (higher is better)"
    assert "| 1 | trial-00002 (00000002) | 0.9000 ± 0.0100 | 2 | best | ok | 0.02 |" in lines
    assert "| - | trial-00003 (00000003) | - | - | - | nan (fold 0, epoch 1, step 4) | 0.03 |" in lines
    assert "All trials: `batch_size=8`" in lines and "| 8 | none | 3 | 1 |" in lines
    assert "test_accuracy **0.8750**" in lines and "foldsweep rerun 00000002" in lines
    assert trial_description(trials[0], standings) == (
        "Rank **2** of 2 ranked trials: mean_val_accuracy 0.7000 ± 0.0100 at epoch 2; status ok."
    )
    assert trial_description(trials[2], standings) == "Not ranked: status nan (fold 0, epoch 1, step 4)."


def test_the_compile_share_is_compiling_over_the_summed_wall_of_the_trials_that_recorded_both():
    """A sweep's compile share is its trials' summed compile_s over their summed
    trial_wall_s; a trial that recorded no compile time (it failed first) is left out of both."""
    records = [
        record(0, 0.8, compile_s=3.0, trial_wall_s=10.0),
        record(1, 0.7, compile_s=1.0, trial_wall_s=30.0),
        record(2, None, status=TrialStatus.ERROR, compile_s=math.nan, trial_wall_s=5.0),
    ]
    assert (
        compile_share_text(records) == "compile share 10%: compile_s 4.0 s of the 2 trials' summed trial_wall_s 40.0 s"
    )
    assert compile_share_text(records[1:2]) == "compile share 3%: compile_s 1.0 s of the trial's trial_wall_s 30.0 s"
    assert compile_share_text(records[2:]) is None


def test_the_refit_model_lines_say_how_to_load_and_serve_it_from_any_directory():
    from pathlib import Path

    from pipeline.records.report import refit_model_lines

    tags = {Tag.REFIT_MODEL: "models:/m-1", Tag.REGISTERED_MODEL: "models:/cnn/2"}
    active = refit_model_lines(tags, "sqlite:///mlflow.db")
    store = f"sqlite:///{Path('mlflow.db').resolve()}"
    assert active == [
        "refit model models:/m-1 (Keras flavor; the experiment module saved with it)",
        "registered as models:/cnn/2",
        f"load it: MLFLOW_TRACKING_URI={store} python -c 'import mlflow; model = mlflow.pyfunc.load_model(\"models:/m-1\")'",
        f"serve it: MLFLOW_TRACKING_URI={store} mlflow models serve -m models:/m-1 --env-manager local",
    ]
    elsewhere = refit_model_lines(tags, "http://127.0.0.1:5000", tools=Path("/opt/env/bin"))
    assert elsewhere[2].startswith("load it: MLFLOW_TRACKING_URI=http://127.0.0.1:5000 /opt/env/bin/python -c ")
    assert elsewhere[3].startswith("serve it: PATH=/opt/env/bin:$PATH MLFLOW_TRACKING_URI=http://127.0.0.1:5000 mlflow")
    assert refit_model_lines({Tag.REFIT_MODEL: "error: OSError: disk full"}, "sqlite:///mlflow.db") == []
    assert refit_model_lines({}, "sqlite:///mlflow.db") == []
