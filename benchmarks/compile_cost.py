"""What a trial's compile costs against what its steps save, by the model's size: the calibration of
the plan's compile estimate (``pipeline.contract.plan``).

A residual 1D CNN of B blocks (Conv1D, BatchNormalization, ReLU, Add; MNIST-1D, 3-fold
stratified, batch 8 unless asked) runs as `foldsweep trial` for 2 epochs in each variant: XLA
off, XLA on (one step per launch), XLA with 8 steps per launch, and stacked; XLA off on the one
CPU stacked folds get (``noxla-1cpu``, what stacking saves against); each in its own process
with the persistent compile cache off. A row per model and variant: the model's computing
layers (the plan's size measure), the trial's compile seconds, its training seconds per epoch
(the second epoch's, compiled) and the plan's own estimate. Where stacked and noxla-1cpu ran at
the same sizes and at two batch sizes or more, it also prints stacked folds' saving per fold step
fitted as ``pipeline.contract.compile_cost.STACKED_SAVES_S`` is (``stacked_saving_fit``).

    .venv/bin/python -m benchmarks.compile_cost [--blocks 1,4,16] [--batches 8] \\
        [--variants noxla,xla,xla-x8,stacked,noxla-1cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pipeline.contract.compile_cost import STACKED_SAVES_S, CompileCosts
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
    inputs = keras.Input(shape=(40, 1))
    x = layers.Conv1D(32, 5, padding="same", activation="relu")(inputs)
    for _ in range(blocks):
        y = layers.Conv1D(32, 3, padding="same")(x)
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


def run(directory: Path, blocks: int, variant: str, batch_size: int) -> dict[str, Any]:
    spec = directory / f"b{blocks}-{variant}-{batch_size}.yaml"
    train, cpus = VARIANTS[variant]
    spec.write_text(
        yaml.safe_dump(
            {
                "name": "compile-cost",
                "experiment": str(directory / "residual1d.py") + ":build",
                "dataset": "mnist1d",
                "cv": {"splitter": "stratified", "n_splits": 3, "seed": 0},
                "search": {"space": {"batch_size": batch_size, "learning_rate": 1e-3, "blocks": blocks}},
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
        "layers": 3 + 4 * blocks,
        "variant": variant,
        "batch_size": batch_size,
        "compile_s": compile_s,
        "epoch_s": round(train_s / EPOCHS, 2),
        "estimate_s": float(estimate.group(1)) if estimate else None,
        "plan": printed.splitlines()[1],
    }


def stacked_saving_fit(rows: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Stacked folds' saving per fold step against the graph's side-by-side loops on one core, as
    (base, less per sample of the batch), the form of ``STACKED_SAVES_S``: each pair of
    a stacked and a noxla-1cpu row (same layers and batch size) saves the difference of their
    epoch seconds over the epoch's fold steps, taken in proportion to its own extra compile and
    priced at the plan's estimate of that extra (``CompileCosts``), so that the machine's
    speed on the day cancels; a least-squares line over the pairs. A pair whose stacked form
    compiled no longer is left out (nothing to price); None with fewer than two batch sizes."""
    by_size = {(row["layers"], row["batch_size"], row["variant"]): row for row in rows}
    pairs = []
    for (layers, batch_size, variant), stacked in by_size.items():
        graph = by_size.get((layers, batch_size, "noxla-1cpu"))
        if variant != "stacked" or graph is None:
            continue
        extra = stacked["compile_s"] - graph["compile_s"]
        if extra <= 0:
            continue
        costs = CompileCosts(layers, batch_size)
        priced = costs.compile_s("stacked") - costs.compile_s("graph")
        saved = (graph["epoch_s"] - stacked["epoch_s"]) / (FOLDS * (FOLD_TRAIN_SAMPLES // batch_size))
        pairs.append((batch_size, saved * priced / extra))
    if len({batch_size for batch_size, _ in pairs}) < 2:
        return None
    mean_batch = sum(batch_size for batch_size, _ in pairs) / len(pairs)
    mean_saved = sum(saved for _, saved in pairs) / len(pairs)
    slope = sum((b - mean_batch) * (s - mean_saved) for b, s in pairs) / sum((b - mean_batch) ** 2 for b, _ in pairs)
    return mean_saved - slope * mean_batch, -slope


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="1,4,16")
    parser.add_argument("--batches", default="8")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        (directory / "residual1d.py").write_text(MODEL)
        for blocks in (int(b) for b in args.blocks.split(",")):
            for batch_size in (int(b) for b in args.batches.split(",")):
                for variant in args.variants.split(","):
                    rows.append(run(directory, blocks, variant, batch_size))
                    print(json.dumps(rows[-1]), flush=True)
    print(f"{'layers':>6} {'batch':>5} {'variant':10} {'compile s':>9} {'estimate s':>10} {'epoch s':>8}")
    for r in rows:
        print(
            f"{r['layers']:>6} {r['batch_size']:>5} {r['variant']:10} {r['compile_s']:>9} {r['estimate_s']!s:>10} "
            f"{r['epoch_s']:>8}"
        )
    fit = stacked_saving_fit(rows)
    if fit is not None:
        base, per_sample = fit
        print(
            f"stacked folds save per fold step (STACKED_SAVES_S): {base * 1e3:.3f}e-3 s, less {per_sample * 1e3:.4f}e-3 "
            f"per sample of the batch (the plan's: {STACKED_SAVES_S[0] * 1e3:.3f}e-3, less "
            f"{STACKED_SAVES_S[1] * 1e3:.4f}e-3)"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
