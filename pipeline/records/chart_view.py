"""The chart view of a sweep's shared view in the MLflow UI: its charts in sections by what a
researcher compares (the CV mean curves and the hyperparameters against the objective, then the
folds' own curves, throughput, the time account), every trial plotted.

The state is the UI's own (what its chart view saves): sections and cards keyed as its
``compareRunSections`` and ``compareRunCharts``. The UI adds a chart of its own for every metric
no card names; each metric this view leaves out gets a deleted card, so the view shows what it
lays out and nothing else.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from pipeline.contract.results import (
    ACCOUNT_KEYS,
    COMPILE_S,
    EPOCH_GAP_S,
    EVAL_RATE,
    SELECTED_PREFIX,
    TRAIN_RATE,
    TRIAL_PARTS,
)
from pipeline.inputs.spec import Objective

SECTIONS = ("CV mean", "Per fold", "Throughput", "Time account")
_FOLD_KEY = re.compile(r"split\d+_")
_CV_KEY = re.compile(r"(mean|std)_")
# The layouts, fullest first: a card per fold and score; a card per score with every fold's
# curve; the CV mean section alone.
_LAYOUTS = ("per fold", "per score", "cv mean")


def chart_view(
    objective: Objective, metric_keys: Iterable[str], varying: Sequence[str], *, budget: int = 18000
) -> dict[str, Any]:
    """The UI state keys of the chart view over trials that recorded ``metric_keys`` and differ in
    the params ``varying``: sections, cards, and every run shown. The fullest layout within
    ``budget`` characters of JSON (MLflow keeps an experiment tag's value in 20,000, with the
    table's state); where none fits, the UI's own layout of every metric."""
    keys = set(metric_keys)
    for layout in _LAYOUTS:
        view = _view(objective, keys, varying, layout=layout)
        if len(json.dumps(view)) <= budget:
            return view
    return {"runsHiddenMode": "SHOW_ALL"}


def _view(objective: Objective, keys: set[str], varying: Sequence[str], *, layout: str) -> dict[str, Any]:
    cv = sorted((key for key in keys if _CV_KEY.match(key)), key=lambda key: (key != objective.key, key))
    cards = [_line(key, "CV mean") for key in cv]
    selected = f"{SELECTED_PREFIX}{objective.key}"
    if varying and selected in keys:
        parallel = {"selectedParams": list(varying), "selectedMetrics": [selected], "showAllRuns": True}
        cards.insert(min(1, len(cards)), {**_card("PARALLEL", "CV mean"), **parallel})
    if layout != "cv mean":
        folds = sorted((key for key in keys if _FOLD_KEY.match(key)), key=_fold_order)
        if layout == "per fold":
            cards += [_line(key, "Per fold") for key in folds]
        else:
            for score in dict.fromkeys(key.partition("_")[2] for key in folds):
                of_score = [key for key in folds if key.partition("_")[2] == score]
                cards.append({**_line(of_score[0], "Per fold"), "selectedMetricKeys": of_score, "displayName": score})
        throughput = [key for key in (TRAIN_RATE, EVAL_RATE, COMPILE_S) if key in keys]
        cards += [_line(key, "Throughput") for key in throughput]
        account = dict.fromkeys((*ACCOUNT_KEYS, *TRIAL_PARTS))
        cards += [_bar(key, "Time account") for key in account if key in keys and key not in throughput]
        cards += [_line(EPOCH_GAP_S, "Time account")] if EPOCH_GAP_S in keys else []
    cards = [{"uuid": f"foldsweep-{number}", **card} for number, card in enumerate(cards)]
    shown = {card["metricKey"] for card in cards if "metricKey" in card}
    # A card naming a metric keeps the UI from charting it on its own; deleted, it shows nothing.
    cards += [{"metricKey": key, "deleted": True} for key in sorted(keys - shown)]
    return {
        "compareRunSections": [{"uuid": _section_id(name), "name": name, "display": True} for name in SECTIONS],
        "compareRunCharts": cards,
        "runsHiddenMode": "SHOW_ALL",
        "isAccordionReordered": True,
    }


def _fold_order(key: str) -> tuple[str, int]:
    """``split10_val_loss`` after ``split2_val_loss``: by what is scored, then by fold."""
    fold, _, name = key.partition("_")
    return name, int(fold.removeprefix("split"))


def _section_id(name: str) -> str:
    return "foldsweep-section-" + name.lower().replace(" ", "-")


def _card(kind: str, section: str) -> dict[str, Any]:
    return {"type": kind, "metricSectionId": _section_id(section)}


def _line(key: str, section: str) -> dict[str, Any]:
    """A metric's curve over the epochs (MLflow's steps), unsmoothed (the UI smooths unless told)."""
    return {**_card("LINE", section), "metricKey": key, "lineSmoothness": 0}


def _bar(key: str, section: str) -> dict[str, Any]:
    """A value recorded once per trial, a bar per trial."""
    return {**_card("BAR", section), "metricKey": key}
