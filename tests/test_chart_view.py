"""The chart view of a sweep's shared view (pipeline.records.chart_view): what it lays out where,
and that it stays within MLflow's tag size however many folds and scores a sweep records."""

from __future__ import annotations

import json

from pipeline.base.mlflow_private import MLFLOW_VIEW_STATE_NAMES
from pipeline.inputs.spec import Objective
from pipeline.records.chart_view import SECTIONS, chart_view

SCORES = ("val_loss", "val_accuracy", "train_loss", "val_auc", "val_f1", "train_accuracy")
ONCE = ("trial_wall_s", "setup_s", "train_s", "eval_s", "gap_s", "other_s", "best_epoch", "n_params", "retries")


def metric_keys(folds: int) -> set[str]:
    keys = {f"split{fold}_{score}" for fold in range(folds) for score in SCORES}
    keys |= {f"{kind}_{score}" for kind in ("mean", "std", "selected_mean", "selected_std") for score in SCORES}
    return keys | {"train_samples_per_s", "eval_samples_per_s", "compile_s", "epoch_gap_s", *ONCE}


def shown(view: dict, section: str) -> list[dict]:
    (uuid,) = [entry["uuid"] for entry in view["compareRunSections"] if entry["name"] == section]
    return [card for card in view["compareRunCharts"] if card.get("metricSectionId") == uuid]


def test_the_view_lays_out_the_cv_curves_first_then_folds_throughput_and_time_and_hides_the_rest():
    keys = metric_keys(folds=3)
    view = chart_view(Objective(metric="accuracy"), keys, ["learning_rate", "batch_size"])
    assert [section["name"] for section in view["compareRunSections"]] == list(SECTIONS)
    assert view["runsHiddenMode"] == "SHOW_ALL" and view["isAccordionReordered"] is True
    cv = shown(view, "CV mean")
    assert cv[0]["metricKey"] == "mean_val_accuracy" and cv[0]["lineSmoothness"] == 0
    assert cv[1]["type"] == "PARALLEL" and cv[1]["selectedParams"] == ["learning_rate", "batch_size"]
    assert cv[1]["selectedMetrics"] == ["selected_mean_val_accuracy"] and cv[1]["showAllRuns"] is True
    curves = {card["metricKey"] for card in cv if card["type"] == "LINE"}
    assert curves == {key for key in keys if key.startswith(("mean_", "std_"))}
    folds = [card["metricKey"] for card in shown(view, "Per fold")]
    assert folds[:3] == ["split0_train_accuracy", "split1_train_accuracy", "split2_train_accuracy"]
    assert len(folds) == 18
    assert [card["metricKey"] for card in shown(view, "Throughput")] == [
        "train_samples_per_s",
        "eval_samples_per_s",
        "compile_s",
    ]
    time_cards = shown(view, "Time account")
    assert {card["metricKey"]: card["type"] for card in time_cards}["trial_wall_s"] == "BAR"
    assert time_cards[-1] == {**time_cards[-1], "metricKey": "epoch_gap_s", "type": "LINE"}
    # Every metric is named by exactly one card, so the UI charts none on its own.
    named = [card["metricKey"] for card in view["compareRunCharts"] if "metricKey" in card]
    assert sorted(named) == sorted(keys)
    hidden = {card["metricKey"] for card in view["compareRunCharts"] if card.get("deleted")}
    assert hidden == {"best_epoch", "n_params", "retries"} | {key for key in keys if key.startswith("selected_")}


def test_many_folds_get_a_card_per_score_and_the_view_always_fits_mlflows_tag():
    many = chart_view(Objective(), metric_keys(folds=25), ["learning_rate"])
    per_fold = shown(many, "Per fold")
    assert len(per_fold) == len(SCORES) and per_fold[0]["displayName"] == "train_accuracy"
    assert per_fold[0]["selectedMetricKeys"] == [f"split{fold}_train_accuracy" for fold in range(25)]
    more = chart_view(Objective(), metric_keys(folds=40), ["learning_rate"])
    assert shown(more, "Per fold") == [] and shown(more, "CV mean")[0]["metricKey"] == "mean_val_accuracy"
    for view in (many, more):
        assert len(json.dumps(view)) <= 18000
        named = sorted(card["metricKey"] for card in view["compareRunCharts"] if "metricKey" in card)
        assert named == sorted(metric_keys(folds=25 if view is many else 40))
    assert chart_view(Objective(), metric_keys(folds=100), []) == {"runsHiddenMode": "SHOW_ALL"}


def test_every_name_the_view_writes_is_one_the_mlflow_ui_hook_checks():
    """The UI's own names (what the shared-view hook finds in the installed UI's scripts), or
    foldsweep's values (uuids, names, metric keys)."""
    view = chart_view(Objective(), metric_keys(folds=25), ["learning_rate"])
    written = set(view) | {key for card in view["compareRunCharts"] for key in card}
    written |= {key for section in view["compareRunSections"] for key in section}
    ui_generic = {"uuid", "type", "name", "display", "deleted"}
    assert written - ui_generic <= set(MLFLOW_VIEW_STATE_NAMES)
    assert view["runsHiddenMode"] in MLFLOW_VIEW_STATE_NAMES
