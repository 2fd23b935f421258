"""The corrected resampled t-test, the epoch a trial is scored at, and the standings built on them."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO
from scipy import stats

from pipeline.contract.results import EpochSelection, TrialStatus
from pipeline.inputs.spec import Objective
from pipeline.records.report import (
    Standings,
    cv_results,
    leaderboard_table,
    replica_scores,
    split_params,
    sweep_description,
)
from pipeline.records.significance import corrected_ttest, val_train_ratio
from pipeline.records.tracking import TrialRecord

# Six paired differences (2 repeats x 3 folds), worked by hand:
#   mean = 0.14 / 6 = 0.0233333, unbiased variance = 0.0023333 / 5 = 4.66667e-4
#   corrected variance = 4.66667e-4 * (1/6 + n_val/n_train) with n_val/n_train = 1/(3 - 1) = 0.5
#                      = 3.11111e-4, so t = 0.0233333 / sqrt(3.11111e-4) = 1.32288 on 5 df
#   uncorrected (a plain paired t-test): t = 0.0233333 / sqrt(4.66667e-4 / 6) = 2.64575
DIFFERENCES = [0.02, 0.05, -0.01, 0.03, 0.04, 0.01]


def sklearn_example_corrected_ttest(differences, df, n_train, n_test):
    """The functions of scikit-learn's example "Statistical comparison of models using grid search"."""
    kr = len(differences)
    corrected_var = np.var(differences, ddof=1) * (1 / kr + n_test / n_train)
    t_stat = np.mean(differences) / np.sqrt(corrected_var)
    return t_stat, stats.t.sf(np.abs(t_stat), df)


def test_the_corrected_ttest_matches_the_hand_worked_case_and_the_sklearn_example():
    comparison = corrected_ttest(DIFFERENCES, val_train_ratio=val_train_ratio(3))
    assert comparison.t == pytest.approx(1.32288, rel=1e-5)
    assert comparison.pvalue == pytest.approx(stats.t.sf(1.3228757, 5), rel=1e-6)
    t_stat, p_val = sklearn_example_corrected_ttest(np.array(DIFFERENCES), 5, n_train=2000, n_test=1000)
    assert comparison.t == pytest.approx(t_stat, rel=1e-12) and comparison.pvalue == pytest.approx(p_val, rel=1e-12)
    assert comparison.tied  # p = 0.12


def test_the_pvalue_is_scipy_stats_t_sf_to_the_bit_without_loading_scipy_stats():
    rng = np.random.default_rng(0)
    for replicas in (2, 3, 5, 10, 30):
        for shift in (-0.05, 0.0, 0.02, 0.3):  # the best worse, level, better, far better
            differences = (rng.normal(shift, 0.02, size=replicas)).tolist()
            comparison = corrected_ttest(differences, val_train_ratio=0.25)
            assert comparison.pvalue == float(stats.t.sf(comparison.t, replicas - 1))
    # Ending a sweep (its standings) no longer loads scipy.stats, 0.6 s of a 2-core machine.
    script = (
        "import sys\nfrom pipeline.records.significance import corrected_ttest\n"
        "print(corrected_ttest([0.02, 0.05, -0.01], val_train_ratio=0.5).pvalue, 'scipy.stats' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    pvalue, loaded = done.stdout.split()
    assert float(pvalue) == corrected_ttest([0.02, 0.05, -0.01], val_train_ratio=0.5).pvalue and loaded == "False"


def test_the_correction_term_is_what_keeps_overlapping_training_sets_from_looking_significant():
    plain = corrected_ttest(DIFFERENCES, val_train_ratio=0.0)  # the correction term left out
    assert plain.t == pytest.approx(2.64575, rel=1e-5)
    assert plain.pvalue == pytest.approx(0.0228296, rel=1e-4) and not plain.tied
    corrected = corrected_ttest(DIFFERENCES, val_train_ratio=val_train_ratio(3))
    assert corrected.pvalue > 5 * plain.pvalue and corrected.tied
    assert val_train_ratio(5) == pytest.approx(0.25)  # 4/5 of the data trains, 1/5 validates


def test_identical_scores_are_tied_and_a_constant_advantage_is_not():
    assert corrected_ttest([0.0] * 6, val_train_ratio=0.5).pvalue == 1.0
    assert corrected_ttest([0.1] * 6, val_train_ratio=0.5).pvalue == 0.0
    with pytest.raises(ValueError):
        corrected_ttest([0.1], val_train_ratio=0.5)
    with pytest.raises(ValueError):
        corrected_ttest([0.1, math.nan], val_train_ratio=0.5)


@pytest.mark.parametrize(
    "rule, metric, curve, expected",
    [
        ("best_epoch", "accuracy", {1: 0.5, 2: 0.7, 3: 0.6}, 2),
        ("best_epoch", "accuracy", {1: 0.5, 2: 0.7, 3: 0.7}, 2),  # the earliest of equal epochs
        ("best_epoch", "loss", {1: 0.9, 2: 0.4, 3: 0.6}, 2),
        ("best_epoch", "accuracy", {1: 0.5, 2: math.nan, 3: 0.4}, 1),
        ("last", "accuracy", {1: 0.5, 2: 0.7, 3: 0.6}, 3),
        ("best_epoch", "accuracy", {1: math.nan}, None),
    ],
)
def test_the_epoch_is_chosen_on_the_mean_cv_curve(rule, metric, curve, expected):
    assert EpochSelection(Objective.for_metric(metric), rule).epoch(curve) == expected


def test_the_selection_records_every_cv_score_of_one_epoch_for_all_replicas():
    # Fold 1 peaks at epoch 3, but the mean peaks at epoch 2: one epoch for all replicas.
    rows = {
        1: {"mean_val_accuracy": 0.5, "split0_val_accuracy": 0.5, "split1_val_accuracy": 0.5, "compile_s": 3.0},
        2: {
            "mean_val_accuracy": 0.7,
            "split0_val_accuracy": 0.8,
            "split1_val_accuracy": 0.6,
            "std_val_loss": 0.1,
            "split1_train_samples_per_s": 900.0,
        },
        3: {"mean_val_accuracy": 0.65, "split0_val_accuracy": 0.6, "split1_val_accuracy": 0.7},
    }
    selected = EpochSelection(Objective()).selected_metrics(rows)
    assert selected == {
        "best_epoch": 2.0,
        "selected_mean_val_accuracy": 0.7,
        "selected_split0_val_accuracy": 0.8,
        "selected_split1_val_accuracy": 0.6,
        "selected_std_val_loss": 0.1,
    }


def record(name: str, splits: list[float], *, status: str = "ok", epoch: int = 3, lr: str = "0.01") -> TrialRecord:
    metrics = {f"selected_split{j}_val_accuracy": value for j, value in enumerate(splits)}
    metrics.update(
        {
            "selected_mean_val_accuracy": float(np.mean(splits)),
            "selected_std_val_accuracy": float(np.std(splits)),
            "best_epoch": float(epoch),
            # the last epoch's scores, which a selection must not rank on
            "mean_val_accuracy": 0.99 - float(np.mean(splits)),
        }
    )
    return TrialRecord(
        run_id=f"run-{name}",
        run_name=name,
        trial_id=name,
        state="FINISHED",
        status=TrialStatus(status),
        params={"learning_rate": lr},
        metrics=metrics,
    )


def test_standings_rank_on_the_selected_epoch_and_compare_each_trial_with_the_best():
    best = record("best", [0.80, 0.82, 0.79, 0.81, 0.80, 0.83])
    close = record("close", [0.80, 0.81, 0.80, 0.80, 0.79, 0.82], epoch=2)
    broken = record("broken", [0.10, 0.11, 0.09, 0.10, 0.12, 0.10], lr="1e-07")
    nan = record("nan", [0.9] * 6, status="nan")
    standings = Standings.of([broken, nan, close, best], Objective(), n_splits=3)
    assert [r.run_name for r in standings.ranked] == ["best", "close", "broken"]
    assert standings.pvalue(best) == 1.0 and standings.pvalue(nan) is None
    assert standings.pvalue(close) >= 0.05 and standings.pvalue(broken) < 1e-4
    assert [r.run_name for r in standings.tied_with_best()] == ["close"]
    assert standings.ties_line().startswith("1 of the 2 other ranked trials is statistically indistinguishable")
    differences = [b - c for b, c in zip(replica_scores(best, Objective()), replica_scores(close, Objective()))]
    assert standings.pvalue(close) == corrected_ttest(differences, val_train_ratio=0.5).pvalue
    rows = {row["trial_id"]: row for row in cv_results(standings)}
    assert rows["close"]["best_epoch"] == 2 and rows["close"]["split5_val_accuracy"] == 0.82
    assert rows["close"]["tied_with_best"] is True and rows["broken"]["tied_with_best"] is False
    assert rows["best"]["pvalue_vs_best"] == 1.0 and rows["nan"]["pvalue_vs_best"] == ""
    assert rows["best"]["rank_val_accuracy"] == 1 and rows["broken"]["rank_val_accuracy"] == 3
    assert leaderboard_table(standings).columns[5].header == "vs best"


def test_trials_recorded_before_selection_rank_on_their_last_epoch_without_pvalues():
    old = [
        TrialRecord(
            run_id=f"r{i}",
            run_name=f"t{i}",
            trial_id=f"t{i}",
            state="FINISHED",
            status=TrialStatus.OK,
            params={},
            metrics={"mean_val_accuracy": score, "split0_val_accuracy": score, "split1_val_accuracy": score},
        )
        for i, score in enumerate([0.5, 0.7])
    ]
    standings = Standings.of(old, Objective(), n_splits=None)
    assert [r.run_name for r in standings.ranked] == ["t1", "t0"]
    assert standings.comparisons == {} and standings.ties_line() == ""


def test_the_sweep_description_says_how_many_are_tied_and_keeps_its_table_whole_when_cut():
    from pipeline.records.report import DESCRIPTION_BUDGET, sweep_description

    records = [
        record(f"trial-{i:03d}", [0.8 - i * 0.001 + j * 0.01 for j in range(6)], lr=str(0.001 * (i + 1)))
        for i in range(200)
    ]
    text = sweep_description(Standings.of(records, Objective(), n_splits=3), sweep_name="many")
    assert len(text) <= DESCRIPTION_BUDGET
    assert "statistically indistinguishable from the best" in text.splitlines()[2]
    table = [line for line in text.split("### NaN")[0].splitlines() if line.startswith("|")]
    assert "more trials in `cv_results.csv`" in table[-1]
    assert {line.count("|") for line in table} == {table[0].count("|")}  # every row has the header's cells


def test_equal_scores_share_a_rank_in_every_view():
    first, second = record("a", [1.0, 1.0, 1.0]), record("b", [1.0, 1.0, 1.0])
    third = record("c", [0.5, 0.6, 0.7])
    standings = Standings.of([third, second, first], Objective(), n_splits=3)
    assert [standings.rank(r) for r in (first, second, third)] == [1, 1, 3]
    rows = {row["run_id"]: row for row in cv_results(standings)}
    assert [rows[r.run_id]["rank_val_accuracy"] for r in (first, second, third)] == [1, 1, 3]
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(leaderboard_table(standings))
    ranks = [line.split("│")[1].strip() for line in console.export_text().splitlines() if line.startswith("│")]
    assert ranks == ["1", "1", "3"]
    description = sweep_description(standings, sweep_name="tied")
    assert [
        line.split("|")[1].strip() for line in description.splitlines() if line.startswith("| ") and "trial-" in line
    ] == ["1", "1", "3"]
    assert standings.versus_best(standings.ranked[0]) == "best"
    assert standings.versus_best(standings.ranked[1]).startswith("tied (p=1")


def test_an_in_effect_learning_rate_that_repeats_the_hypermodels_own_is_one_column():
    records = [
        TrialRecord(
            run_id=f"r{i}",
            run_name=f"t{i}",
            trial_id=f"x_{i:05d}",
            state="FINISHED",
            status=TrialStatus.OK,
            params={"lr": lr, "learning_rate": lr, "units": units},
            metrics={},
        )
        for i, (lr, units) in enumerate([("0.01", "8"), ("0.001", "8"), ("0.01", "16")])
    ]
    assert split_params(records) == (["lr", "units"], {})
    assert [
        key for key in cv_results(Standings.of(records, Objective(), n_splits=3))[0] if key.startswith("param_")
    ] == ["param_lr", "param_units"]
    # Where the two differ (the spec replaced the hypermodel's rate), both are shown.
    different = [TrialRecord(**{**vars(r), "params": {**r.params, "learning_rate": "0.5"}}) for r in records[:2]]
    assert split_params(different) == (["lr"], {"learning_rate": "0.5", "units": "8"})


def test_the_learning_curve_title_counts_what_it_highlights(tmp_path):
    from pipeline.records.plots import HIGHLIGHTED, _learning_curves, learning_curve_data

    records = [record("a", [0.8, 0.8, 0.8]), record("b", [0.7, 0.7, 0.7])]
    histories = {r.run_id: [(1, 0.5), (2, 0.6)] for r in records}
    curves = learning_curve_data(records, Objective(), histories)
    assert HIGHLIGHTED > len(curves) and sum(0 < curve.rank <= HIGHLIGHTED for curve in curves) == 2
    import matplotlib.pyplot as plt

    figure = _learning_curves(curves, Objective())
    titles = [axes.get_title() for axes in figure.axes]
    plt.close(figure)
    assert titles == ["learning curves: 2 trials, the 2 best highlighted (o: the epoch each is scored at)"]
