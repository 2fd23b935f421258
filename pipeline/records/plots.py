"""The sweep's plots, drawn from recorded trials (what MLflow holds), as PNG artifacts.

Besides the score, NaN and throughput plots against batch size: the CV mean of every trial
against the epoch (``learning_curves.png``), and every searched hyperparameter as an axis with
one line per trial coloured by its score (``parallel_coordinates.png``, as W&B sweeps draw it).
The data behind the last two comes from ``learning_curve_data`` and
``parallel_coordinates_data``, so what is drawn can be checked without reading pixels.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.contract.account import TimeAccount
from pipeline.contract.results import NAN_EPOCH, TRAIN_RATE, TrialStatus, trial_account
from pipeline.inputs.spec import Objective
from pipeline.records.report import _group, nan_table_rows, selected_epoch, selected_score, shared_ranks, split_params
from pipeline.records.tracking import Tag, TrialRecord

PLOTS = (
    "score_vs_batch_size.png",
    "nan_rate_heatmap.png",
    "throughput_vs_batch_size.png",
    "time_account.png",
    "learning_curves.png",
    "parallel_coordinates.png",
)
HIGHLIGHTED = 3  # the best trials drawn bold in the learning curves


@dataclass(frozen=True)
class Curve:
    """One trial's CV mean per epoch; ``rank`` 1 is the best (0: not ranked); ``nan_at`` the
    epoch where it stopped on NaN; ``selected_at`` the epoch it is scored at (train.select)."""

    run_name: str
    epochs: tuple[int, ...]
    scores: tuple[float, ...]
    rank: int = 0
    nan_at: int | None = None
    selected_at: int | None = None


def learning_curve_data(
    records: Sequence[TrialRecord], objective: Objective, histories: Mapping[str, Sequence[tuple[int, float]]]
) -> list[Curve]:
    """A curve per trial that recorded any epoch."""
    ranks = shared_ranks(records, objective)
    curves = []
    for record in records:
        points = sorted(histories.get(record.run_id, ()))
        if not points:
            continue
        nan_at = int(record.tags.get(Tag.of(NAN_EPOCH), points[-1][0])) if record.status is TrialStatus.NAN else None
        curves.append(
            Curve(
                record.run_name,
                tuple(step for step, _ in points),
                tuple(value for _, value in points),
                ranks.get(record.run_id, 0),
                nan_at,
                selected_epoch(record),
            )
        )
    return curves


@dataclass(frozen=True)
class Coordinates:
    """Every varying hyperparameter as an axis (values mapped to 0..1, categories in order),
    one row per trial with a finite score."""

    axes: tuple[str, ...]
    ticks: tuple[tuple[str, ...], ...]
    rows: tuple[tuple[float, ...], ...]
    scores: tuple[float, ...]
    run_names: tuple[str, ...]


def parallel_coordinates_data(records: Sequence[TrialRecord], objective: Objective) -> Coordinates:
    scores = [(record, score) for record in records if (score := selected_score(record, objective.key)) is not None]
    scored = [record for record, _ in scores]
    axes, _ = split_params(scored)
    positions: list[dict[str, float]] = []
    ticks = []
    for axis in axes:
        values = sorted({record.params.get(axis, "-") for record in scored}, key=_sortable)
        spread = max(len(values) - 1, 1)
        positions.append({value: index / spread for index, value in enumerate(values)})
        ticks.append(tuple(tick_label(value) for value in values))
    rows = tuple(
        tuple(position[record.params.get(axis, "-")] for axis, position in zip(axes, positions)) for record in scored
    )
    return Coordinates(
        tuple(axes),
        tuple(ticks),
        rows,
        tuple(score for _, score in scores),
        tuple(record.run_name for record in scored),
    )


# A category longer than this (a learning-rate schedule's call) is cut to its start on an axis.
MAX_TICK_CHARS = 24


def tick_label(value: str) -> str:
    """A category's label on an axis: ``ExponentialDecay(0.01…)`` for a schedule's whole call."""
    if len(value) <= MAX_TICK_CHARS:
        return value
    name, parenthesis, arguments = value.partition("(")
    if parenthesis:
        return f"{name}({arguments.split(',')[0].rstrip(')')}…)"
    return value[: MAX_TICK_CHARS - 1] + "…"


def _sortable(value: str) -> tuple[int, float, str]:
    try:
        return 0, float(value), ""
    except ValueError:
        return 1, 0.0, value


# Held while matplotlib loads: ``matplotlib.use`` switches pyplot's backend when pyplot is in
# sys.modules, which fails on a pyplot another thread is still importing (the early load beside
# the last trials, and the plots once they end).
_LOADING = threading.Lock()


def load_matplotlib() -> None:
    """matplotlib and pyplot, drawing to files (Agg: no display). ~0.5 s of CPU on a 2-core
    machine, which ``PlottingLoadedEarly`` spends beside the last trials; a second caller waits
    for the first."""
    with _LOADING:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401


def write_plots(
    records: Sequence[TrialRecord],
    objective: Objective,
    directory: Path,
    histories: Mapping[str, Sequence[tuple[int, float]]],
) -> list[Path]:
    """The sweep's plots as PNG files in ``directory`` (``PLOTS``); returns their paths.
    ``histories`` is each trial run's objective per epoch (``Tracker.metric_histories``)."""
    load_matplotlib()
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, figure in plot_figures(records, objective, histories).items():
        figure.savefig(directory / name, dpi=100)
        plt.close(figure)
        paths.append(directory / name)
    return paths


def plot_figures(
    records: Sequence[TrialRecord], objective: Objective, histories: Mapping[str, Sequence[tuple[int, float]]]
) -> dict[str, Any]:
    """Each of ``PLOTS`` as a matplotlib figure, laid out (the caller saves and closes them)."""
    load_matplotlib()
    figures = [
        _score_vs_batch_size(records, objective),
        _nan_rates(records),
        _throughput(records),
        _time_account(time_account_data(records)),
        _learning_curves(learning_curve_data(records, objective, histories), objective),
        _parallel_coordinates(parallel_coordinates_data(records, objective), objective),
    ]
    for figure in figures:
        figure.tight_layout()
        # tight_layout leaves a placeholder layout engine, for which savefig draws the whole figure
        # once more before it renders it; the layout is final, so the figure keeps none.
        figure.set_layout_engine(None)
    return dict(zip(PLOTS, figures))


def _batches(records: Sequence[TrialRecord]) -> list[int]:
    return sorted({b for b in (_group(record)[0] for record in records) if b is not None})


def _score_vs_batch_size(records: Sequence[TrialRecord], objective: Objective) -> Any:
    import matplotlib.pyplot as plt

    key = objective.key
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for kind in sorted({_group(record)[1] for record in records}):
        points = [
            (batch, score)
            for r in records
            if _group(r)[1] == kind
            and r.status in (TrialStatus.OK, TrialStatus.PRUNED)
            and (score := selected_score(r, key)) is not None
            and (batch := _group(r)[0]) is not None
        ]
        axes.scatter([batch for batch, _ in points], [score for _, score in points], label=kind, alpha=0.8)
    failed = [batch for r in records if r.status is TrialStatus.NAN and (batch := _group(r)[0]) is not None]
    if failed:
        bottom = min((score for r in records if (score := selected_score(r, key)) is not None), default=0.0)
        axes.scatter(failed, [bottom] * len(failed), marker="x", color="red", label="NaN")
    _batch_axis(axes, _batches(records))
    axes.set_ylabel(key)
    axes.set_title(f"{key} vs batch size, by gradient clipping")
    if axes.get_legend_handles_labels()[0]:  # no scored trial (all failed early): no legend to draw
        axes.legend(title="clipping")
    return figure


def _nan_rates(records: Sequence[TrialRecord]) -> Any:
    import matplotlib.pyplot as plt
    import numpy as np

    kinds, batches = sorted({_group(record)[1] for record in records}), _batches(records)
    rates = np.full((len(kinds), max(len(batches), 1)), np.nan)
    labels = [["" for _ in range(rates.shape[1])] for _ in kinds]
    for row in nan_table_rows(records):
        if row["batch_size"] is None:
            continue
        i, j = kinds.index(row["clipping"]), batches.index(row["batch_size"])
        rates[i, j] = row["nan"] / row["trials"]
        labels[i][j] = f"{row['nan']}/{row['trials']}"
    figure, axes = plt.subplots(figsize=(7, 3.5))
    # An empty grid (no trial recorded a batch size) would make matplotlib warn about its limits.
    image = axes.imshow(rates if kinds else np.full((1, 1), np.nan), cmap="Reds", vmin=0, vmax=1, aspect="auto")
    axes.set_xticks(range(len(batches)), [str(b) for b in batches])
    axes.set_yticks(range(len(kinds)), kinds)
    for i in range(len(kinds)):
        for j in range(len(batches)):
            axes.text(j, i, labels[i][j], ha="center", va="center", fontsize=9)
    axes.set_xlabel("batch size")
    axes.set_ylabel("clipping")
    axes.set_title("share of trials that went NaN")
    figure.colorbar(image, ax=axes)
    return figure


def _throughput(records: Sequence[TrialRecord]) -> Any:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    measured = [
        (batch, r.metrics[TRAIN_RATE])
        for r in records
        if math.isfinite(r.metrics.get(TRAIN_RATE, math.nan)) and (batch := _group(r)[0]) is not None
    ]
    axes.scatter([batch for batch, _ in measured], [rate for _, rate in measured], alpha=0.8)
    _batch_axis(axes, _batches(records))
    axes.set_ylabel("training samples/s (all folds, compilation excluded)")
    axes.set_title("training throughput vs batch size")
    return figure


def time_account_data(records: Sequence[TrialRecord]) -> list[tuple[str, TimeAccount]]:
    """Each trial with a time account, labelled with its number and batch size."""
    accounts = []
    for record in records:
        account = trial_account(record.metrics)
        if account is not None:
            batch = _group(record)[0]
            accounts.append((record.label + (f"\nbatch {batch}" if batch is not None else ""), account))
    return accounts


def _time_account(accounts: Sequence[tuple[str, TimeAccount]]) -> Any:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(max(7, 0.6 * len(accounts) + 2), 4.5))
    names = list(accounts[0][1].as_dict()) if accounts else []
    bottoms = [0.0] * len(accounts)
    for name in names:
        # other_s can come out a little below zero (clocks read a moment apart): drawn as none
        heights = [max(0.0, account.as_dict()[name]) for _, account in accounts]
        axes.bar(range(len(accounts)), heights, bottom=bottoms, label=name)
        bottoms = [bottom + height for bottom, height in zip(bottoms, heights)]
    axes.set_xticks(range(len(accounts)), [label for label, _ in accounts], fontsize=7)
    axes.set_ylabel("seconds of the trial's wall clock")
    axes.set_title("where each trial's time went")
    if names:
        axes.legend(fontsize=8)
    return figure


def _batch_axis(axes: Any, batches: Sequence[int]) -> None:
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(batches), [str(batch) for batch in batches])
    axes.minorticks_off()
    axes.set_xlabel("batch size")


def _learning_curves(curves: Sequence[Curve], objective: Objective) -> Any:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(8, 4.8))
    for curve in sorted(curves, key=lambda c: (0 < c.rank <= HIGHLIGHTED, -c.rank)):
        best = 0 < curve.rank <= HIGHLIGHTED
        axes.plot(
            curve.epochs,
            curve.scores,
            linewidth=2.2 if best else 0.8,
            alpha=1.0 if best else 0.35,
            color=None if best else "grey",
            label=f"#{curve.rank} {curve.run_name}" if best else None,
        )
        if best and curve.selected_at in curve.epochs:
            chosen = curve.epochs.index(curve.selected_at)
            axes.scatter(
                [curve.selected_at], [curve.scores[chosen]], marker="o", facecolors="none", edgecolors="black", zorder=3
            )
        if curve.nan_at is not None:
            stop = curve.epochs.index(curve.nan_at) if curve.nan_at in curve.epochs else -1
            axes.scatter([curve.epochs[stop]], [curve.scores[stop]], marker="x", color="red", zorder=3)
    if any(curve.nan_at is not None for curve in curves):
        axes.scatter([], [], marker="x", color="red", label="went NaN")
    axes.set_xlabel("epoch")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel(f"{objective.key} (CV mean)")
    highlighted = sum(0 < curve.rank <= HIGHLIGHTED for curve in curves)
    axes.set_title(
        f"learning curves: {len(curves)} trials, the {highlighted} best highlighted (o: the epoch each is scored at)"
    )
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=8)
    return figure


def _parallel_coordinates(data: Coordinates, objective: Objective) -> Any:
    import matplotlib
    import matplotlib.pyplot as plt
    from matplotlib import cm, colors

    figure, axes = plt.subplots(figsize=(max(6, 1.6 * len(data.axes) + 2), 4.8))
    if data.rows and data.axes:
        norm = colors.Normalize(min(data.scores), max(data.scores))
        cmap = matplotlib.colormaps["viridis" if objective.mode == "max" else "viridis_r"]
        positions = range(len(data.axes))
        for row, score in sorted(
            zip(data.rows, data.scores), key=lambda pair: objective.sort_key(pair[1]), reverse=True
        ):
            axes.plot(positions, row, color=cmap(norm(score)), alpha=0.8)
        for position, labels in zip(positions, data.ticks):
            axes.axvline(position, color="black", linewidth=0.6)
            for index, label in enumerate(labels):
                axes.text(position, index / max(len(labels) - 1, 1), f" {label}", fontsize=7, va="center")
        # Room right of the last axis for its values, which are written beside it.
        widest = max((len(label) for label in data.ticks[-1]), default=0)
        axes.set_xlim(-0.3, len(data.axes) - 1 + max(0.3, 0.05 * widest))
        axes.set_xticks(list(positions), list(data.axes), rotation=20, ha="right", rotation_mode="anchor")
        figure.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes, label=objective.key)
    axes.set_yticks([])
    axes.set_title(f"hyperparameters of {len(data.rows)} scored trials\ncoloured by {objective.key}", fontsize=11)
    return figure
