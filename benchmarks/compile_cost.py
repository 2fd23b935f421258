"""What a trial's compile costs against what its steps save, by the model's size: the calibration of
the plan's compile estimate (``pipeline.contract.plan``).

A residual 1D CNN of B blocks (Conv1D, BatchNormalization, ReLU, Add; MNIST-1D, 3-fold
stratified, batch 8 unless asked) runs as `foldsweep trial` for 2 epochs in each variant: XLA
off, XLA on (one step per launch), XLA with 8 steps per launch, and stacked; XLA off on the one
CPU stacked folds get (``noxla-1cpu``, what stacking saves against); each in its own process
with the persistent compile cache off. A row per model and variant: the model's computing
layers (the plan's size measure), the trial's compile seconds, its training seconds per epoch
(the second epoch's, compiled) and the plan's own estimate. Where stacked and noxla-1cpu ran at
the same sizes, it also prints stacked folds' saving per fold step fitted as
``pipeline.contract.compile_cost.STACKED_SAVES_S`` is (``stacked_saving_fit``), for the vector
width of this machine's graph kernels (``pipeline.base.host_cpu``; ``ONEDNN_MAX_CPU_ISA=AVX2``
measures the narrower one on an AVX-512 CPU). ``--filters`` sets the convolutions' width, so that
the fit sees the multiply-adds apart from the layers.

    .venv/bin/python -m benchmarks.compile_cost [--blocks 1,4,16] [--batches 8] [--filters 32] \\
        [--variants noxla,xla,xla-x8,stacked,noxla-1cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pipeline.base.host_cpu import graph_vector_width
from pipeline.contract.compile_cost import STACKED_SAVES_S, CompileCosts, multiply_adds
from pipeline.contract.results import COMPILE_S, TRAIN_S

REPO = Path(__file__).resolve().parents[1]
# A variant's train settings and CPUs: side by side on 2 CPUs, stacked on one (the plan stacks
# folds at batch 8 where they would take turns on one compute thread).
VARIANTS: dict[str, tuple[dict[str, Any], int]] = {
    "noxla": ({"jit_compile": False}, 2),
    "xla": ({"jit_compile": True, "steps_per_launch": 1}, 2),
    "xla-x8": ({"jit_compile": True, "steps_per_launch": 8}, 2),
    "stacked": ({"jit_compile": True, "steps_per_launch": 1}, 1),
    "noxla-1cpu": ({"jit_compile": False}, 1),
}
# The calibration's own variants; noxla-1cpu is asked for where stacking's saving is measured.
DEFAULT_VARIANTS = tuple(variant for variant in VARIANTS if variant != "noxla-1cpu")
EPOCHS = 2
# MNIST-1D's 4,000 training samples in 3 stratified folds: each fold trains on 2,666 or 2,667.
FOLDS, FOLD_TRAIN_SAMPLES = 3, 2666
MODEL = """
import keras
from keras import layers


def build(hp):
    blocks = hp.Int("blocks", 1, 256, default=4)
    filters = hp.Int("filters", 8, 256, default=32)
    inputs = keras.Input(shape=(40, 1))
    x = layers.Conv1D(filters, 5, padding="same", activation="relu")(inputs)
    for _ in range(blocks):
        y = layers.Conv1D(filters, 3, padding="same")(x)
        y = layers.BatchNormalization()(y)
        y = layers.ReLU()(y)
        x = layers.Add()([x, y])
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(x))
"""


def seconds(name: str, printed: str) -> float:
    """The seconds ``foldsweep trial`` printed for a part of its time account (``compile_s 1.23``)."""
    found = re.search(rf"{name} ([\d.]+)", printed)
    if found is None:
        raise ValueError(f"foldsweep trial printed no {name}:\n{printed}")
    return float(found.group(1))


@functools.cache
def model_multiply_adds(blocks: int, filters: int) -> int:
    """The benchmark model's multiply-adds per sample, as the plan counts them."""
    from pipeline.inputs.hypermodel import build_model

    namespace: dict[str, Any] = {}
    exec(MODEL, namespace)
    return multiply_adds(build_model(namespace["build"], {"blocks": blocks, "filters": filters}))


def run(directory: Path, blocks: int, variant: str, batch_size: int, filters: int = 32) -> dict[str, Any]:
    spec = directory / f"b{blocks}-f{filters}-{variant}-{batch_size}.yaml"
    train, cpus = VARIANTS[variant]
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "compile-cost",
                "experiment": str(directory / "residual1d.py") + ":build",
                "dataset": "mnist1d",
                "cv": {"splitter": "stratified", "n_splits": 3, "seed": 0},
                "search": {
                    "space": {"batch_size": batch_size, "learning_rate": 1e-3, "blocks": blocks, "filters": filters}
                },
                "train": {"epochs": EPOCHS, "seed": 0, "refit": False, **train},
                "resources": {"cpu": cpus},
                "tracking": {"uri": f"sqlite:///{directory / 'mlflow.db'}"},
            }
        )
    )
    environment = {**os.environ, "FOLDSWEEP_COMPILE_CACHE": "off", "TF_CPP_MIN_LOG_LEVEL": "3"}
    printed = subprocess.run(
        [str(Path(sys.executable).parent / "foldsweep"), "trial", str(spec)],
        capture_output=True,
        text=True,
        check=True,
        env=environment,
        cwd=directory,
    ).stdout
    compile_s = seconds(COMPILE_S, printed)
    train_s = seconds(TRAIN_S, printed)
    estimate = re.search(r"compile ~([\d.]+) s", printed)
    return {
        "blocks": blocks,
        "filters": filters,
        "layers": 3 + 4 * blocks,
        "multiply_adds": model_multiply_adds(blocks, filters),
        "graph_vector_width": graph_vector_width(),
        "variant": variant,
        "batch_size": batch_size,
        "compile_s": compile_s,
        "epoch_s": round(train_s / EPOCHS, 2),
        "estimate_s": float(estimate.group(1)) if estimate else None,
        "plan": printed.splitlines()[1],
    }


def stacked_saving_fit(rows: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Stacked folds' saving per fold step against the graph's side-by-side loops on one core, in
    the form of ``STACKED_SAVES_S``: (per computing layer, less per multiply-add of the batch).
    Each pair of a stacked and a noxla-1cpu row (same layers, filters and batch size) saves the
    difference of their epoch seconds over the epoch's fold steps; all pairs' savings are priced
    at the plan's estimate of the stacked form's extra compile (``CompileCosts``), scaled by the
    plan's summed extra over the one measured, so that the machine's speed on the day cancels
    and no one pair's compile tips it; then a least-squares fit through zero, of the layers'
    term alone where the multiply-adds' would come out negative (stacking is then credited
    nothing for them). A pair whose stacked form compiled no longer is left out; None where the
    pairs cannot tell the layers' part from the multiply-adds' (fewer than two pairs, or all in
    proportion)."""
    by_size = {(row["layers"], row.get("filters"), row["batch_size"], row["variant"]): row for row in rows}
    pairs, measured_extra, priced_extra = [], 0.0, 0.0
    for (layers, filters, batch_size, variant), stacked in by_size.items():
        graph = by_size.get((layers, filters, batch_size, "noxla-1cpu"))
        if variant != "stacked" or graph is None:
            continue
        extra = stacked["compile_s"] - graph["compile_s"]
        if extra <= 0:
            continue
        costs = CompileCosts(layers, batch_size)
        measured_extra += extra
        priced_extra += costs.compile_s("stacked") - costs.compile_s("graph")
        saved = (graph["epoch_s"] - stacked["epoch_s"]) / (FOLDS * (FOLD_TRAIN_SAMPLES // batch_size))
        pairs.append((layers, stacked["multiply_adds"] * batch_size, saved))
    if len(pairs) < 2:
        return None
    # Normal equations of saved = per_layer * layers - per_multiply_add * batch multiply-adds.
    ll = sum(layers * layers for layers, _, _ in pairs)
    lm = sum(layers * adds for layers, adds, _ in pairs)
    mm = sum(adds * adds for _, adds, _ in pairs)
    ls = sum(layers * saved for layers, _, saved in pairs)
    ms = sum(adds * saved for _, adds, saved in pairs)
    determinant = ll * mm - lm * lm
    if determinant <= 1e-2 * ll * mm:  # the multiply-adds all but in proportion to the layers
        return None
    price = priced_extra / measured_extra
    per_layer = (mm * ls - lm * ms) / determinant
    per_multiply_add = (lm * ls - ll * ms) / determinant
    if per_multiply_add < 0:  # the graph's kernels are the slower per multiply-add: no credit for it
        per_layer, per_multiply_add = ls / ll, 0.0
    return per_layer * price, per_multiply_add * price


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="1,4,16")
    parser.add_argument("--batches", default="8")
    parser.add_argument("--filters", default="32")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        (directory / "residual1d.py").write_text(MODEL)
        for blocks in (int(b) for b in args.blocks.split(",")):
            for filters in (int(f) for f in args.filters.split(",")):
                for batch_size in (int(b) for b in args.batches.split(",")):
                    for variant in args.variants.split(","):
                        rows.append(run(directory, blocks, variant, batch_size, filters))
                        print(json.dumps(rows[-1]), flush=True)
    print(
        f"{'layers':>6} {'filters':>7} {'batch':>5} {'variant':10} {'compile s':>9} {'estimate s':>10} {'epoch s':>8}"
    )
    for r in rows:
        print(
            f"{r['layers']:>6} {r['filters']:>7} {r['batch_size']:>5} {r['variant']:10} {r['compile_s']:>9} "
            f"{r['estimate_s']!s:>10} {r['epoch_s']:>8}"
        )
    fit = stacked_saving_fit(rows)
    if fit is not None:
        width = graph_vector_width()
        per_layer, per_multiply_add = fit
        plans_layer, plans_multiply_add = STACKED_SAVES_S[width]
        print(
            f"stacked folds save per fold step (STACKED_SAVES_S[{width!r}]): {per_layer * 1e3:.4f}e-3 s per "
            f"layer, less {per_multiply_add * 1e9:.4f}e-9 per multiply-add of the batch (the plan's: "
            f"{plans_layer * 1e3:.4f}e-3, less {plans_multiply_add * 1e9:.4f}e-9)"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
