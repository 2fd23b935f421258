"""What foldsweep relies on of MLflow beyond its documented API: the names of its UI's shared
views, its SQLite store's tables and its job runner's switch, and where its installed files are.
foldsweep uses no private name of MLflow; these undocumented names are kept here, each named once
(``tests/test_private_hooks.py`` checks that no other module uses a private name of MLflow).

What each gives users, and the check that it still holds on the installed MLflow, is its hook in
``pipeline.base.private_hooks``. Nothing here imports MLflow: its files are found, not loaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# The experiment tag prefix the MLflow UI's "share" button writes a runs view under, and the
# address parameter that opens one: neither is in MLflow's documented API.
MLFLOW_SHARED_VIEW_TAG = "mlflow.sharedViewState."
MLFLOW_SHARED_VIEW_PARAM = "viewStateShareKey"
# What foldsweep's shared view holds beyond the search (filter, order, columns), as the UI's own
# views save it: the table's column order, and the chart view (pipeline.records.chart_view).
MLFLOW_VIEW_STATE_NAMES = (
    "columnOrder",
    "compareRunSections",
    "compareRunCharts",
    "runsHiddenMode",
    "SHOW_ALL",
    "isAccordionReordered",
    "metricSectionId",
    "metricKey",
    "selectedMetricKeys",
    "displayName",
    "lineSmoothness",
    "selectedParams",
    "selectedMetrics",
    "showAllRuns",
)
# Tables every MLflow SQLite store has: how a file is told apart from another program's database.
MLFLOW_STORE_TABLES = frozenset({"experiments", "runs", "alembic_version"})
# `foldsweep ui` turns MLflow's GenAI job runner off with it.
MLFLOW_JOB_EXECUTION_VARIABLE = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


def mlflow_directory() -> Path | None:
    """Where MLflow is installed, found without importing it."""
    spec = importlib.util.find_spec("mlflow")
    return Path(spec.origin).parent if spec is not None and spec.origin is not None else None


def mlflow_ui_scripts() -> list[Path]:
    """The MLflow UI's JavaScript, as installed with MLflow's server."""
    directory = mlflow_directory()
    if directory is None:
        return []
    return sorted((directory / "server" / "js" / "build" / "static" / "js").glob("*.js"))
