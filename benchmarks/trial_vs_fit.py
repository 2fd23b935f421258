"""One trial end to end on images: `foldsweep trial` against the naive loop a researcher writes
(for each fold: build, compile, `fit`, `evaluate`), each its own process timed from start to
exit, on the same images, folds, batch size, epochs and learning rate.

The images are the built-in `shapes` (32x32x3, 10 classes), 3,594 of them in CV, written to a
`.npz` (or `--data PATH`, one written before: a tree without the built-in can be timed on the same
images), split 3-fold stratified (seed 0); both sides use 2 CPU threads. The models are
`benchmarks/image_models.py`'s.

A row per model: both walls, their ratio (naive / foldsweep: above 1, foldsweep is faster), the
trial's compile seconds and its plan line.

    .venv/bin/python -m benchmarks.trial_vs_fit --model image_cnn --model mobilenet_v2 \\
        [--epochs 3] [--batch-size 32] [--data PATH] [--json PATH] [--train jit_compile=true] \\
        [--baseline REV]

`--train KEY=VALUE` sets a `train` key of the trial's spec (repeatable), e.g. to time the step
with XLA where the plan runs it without. `--baseline REV` also times the same trial with the
foldsweep of git revision REV (its package exported to a scratch folder, run with this
environment), in the same run: before and after a change, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from benchmarks import image_models  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODELS = image_models.NAMES
IMAGE_MODELS = Path(image_models.__file__)
LEARNING_RATE = 1e-3
THREADS = 2


def write_images(path: Path) -> Path:
    """The built-in shapes' CV images as a .npz of x and y."""
    import numpy as np

    from pipeline.inputs.datasets import load_dataset
    from pipeline.inputs.spec import DatasetSpec

    data = load_dataset(DatasetSpec(name="shapes", options=image_models.SHAPES_OPTIONS))
    np.savez(path, x=data.x, y=data.y)
    return path


def naive(model: str, data_path: Path, *, epochs: int, batch_size: int) -> None:
    """The researcher's loop, in this process: per fold a fresh model, compile, fit, evaluate."""
    import keras
    import tensorflow as tf

    from pipeline.inputs.datasets import load_dataset
    from pipeline.inputs.folds import make_folds
    from pipeline.inputs.hypermodel import load_builder
    from pipeline.inputs.spec import CVSpec, DatasetSpec

    tf.config.threading.set_intra_op_parallelism_threads(THREADS)
    tf.config.threading.set_inter_op_parallelism_threads(THREADS)
    data = load_dataset(DatasetSpec(path=str(data_path)))
    folds = make_folds(CVSpec(splitter="stratified", n_splits=3, seed=0), data).folds
    build = load_builder(IMAGE_MODELS, model)
    x, y = tf.constant(data.x), tf.constant(data.y)
    scores = []
    for k, fold in enumerate(folds):
        keras.utils.set_random_seed(k)
        net = build(None)
        net.compile(
            optimizer=keras.optimizers.Adam(LEARNING_RATE), loss="sparse_categorical_crossentropy", metrics=["accuracy"]
        )
        train, val = tf.constant(fold.train), tf.constant(fold.val)
        net.fit(tf.gather(x, train), tf.gather(y, train), batch_size=batch_size, epochs=epochs, verbose=0)
        scores.append(net.evaluate(tf.gather(x, val), tf.gather(y, val), verbose=0, return_dict=True)["accuracy"])
        keras.backend.clear_session()
    print(json.dumps({"mean_val_accuracy": sum(scores) / len(scores)}))


def spec(directory: Path, model: str, data_path: Path, *, batch_size: int, train: dict | None = None) -> Path:
    import yaml

    path = directory / f"{model}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": f"trial-vs-fit-{model}",
                "experiment": f"{IMAGE_MODELS}:{model}",
                "dataset": str(data_path),
                "cv": {"splitter": "stratified", "n_splits": 3, "seed": 0},
                "search": {"space": {"batch_size": batch_size, "learning_rate": LEARNING_RATE}},
                "train": {"epochs": 100, "seed": 0, "refit": False, **(train or {})},
                "resources": {"cpu": THREADS},
                "tracking": {"uri": f"sqlite:///{directory / 'mlflow.db'}"},
            }
        )
    )
    return path


def timed(command: list[str], **kwargs) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True, **kwargs)
    return time.perf_counter() - started, done.stdout


def export(revision: str, directory: Path) -> Path:
    """foldsweep's package at a git revision, exported to ``directory`` (its own imports first)."""
    directory.mkdir()
    archive = subprocess.run(["git", "archive", revision, "pipeline"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive.stdout, check=True)
    return directory


def trial(trial_spec: Path, *, epochs: int, package: Path | None = None) -> tuple[float, str]:
    """``foldsweep trial`` timed from process start to exit: this tree's, or the package exported
    to ``package``."""
    arguments = ["trial", str(trial_spec), "--epochs", str(epochs)]
    if package is None:
        return timed([str(Path(sys.executable).parent / "foldsweep"), *arguments])
    environment = {**os.environ, "PYTHONPATH": str(package)}
    return timed([sys.executable, "-m", "pipeline.cli", *arguments], cwd=package, env=environment)


def summary(seconds: float, printed: str) -> dict:
    from pipeline.contract.results import COMPILE_S
    from pipeline.inputs.spec import Objective

    compile_s = re.search(rf"{COMPILE_S} ([\d.]+)", printed)
    plan = re.search(r"^fused: (.*?);", printed, re.MULTILINE) or re.search(r"^unfused: (.*?);", printed, re.MULTILINE)
    accuracy = re.findall(rf"{Objective(metric='accuracy').key} (\S+)$", printed, re.MULTILINE)
    return {
        "s": round(seconds, 1),
        "compile_s": float(compile_s.group(1)) if compile_s else None,
        "plan": plan.group(1) if plan else printed.splitlines()[1],
        "cv": float(accuracy[-1]) if accuracy else None,
    }


def row(
    model: str,
    directory: Path,
    data_path: Path,
    *,
    epochs: int,
    batch_size: int,
    train: dict | None = None,
    baseline: Path | None = None,
) -> dict:
    trial_spec = spec(directory, model, data_path, batch_size=batch_size, train=train)
    ours = summary(*trial(trial_spec, epochs=epochs))
    arguments = ["--naive", model, "--data", str(data_path), "--epochs", str(epochs), "--batch-size", str(batch_size)]
    theirs, naive_printed = timed([sys.executable, "-m", "benchmarks.trial_vs_fit", *arguments], cwd=REPO)
    result = {
        "model": model,
        "foldsweep_s": ours["s"],
        "naive_s": round(theirs, 1),
        "faster_by": round(theirs / ours["s"], 2),
        "compile_s": ours["compile_s"],
        "plan": ours["plan"],
        "foldsweep_cv": ours["cv"],
        "naive_cv": round(json.loads(naive_printed.strip().splitlines()[-1])["mean_val_accuracy"], 4),
    }
    if baseline is not None:
        before = summary(*trial(trial_spec, epochs=epochs, package=baseline))
        result.update(
            baseline_s=before["s"],
            baseline_faster_by=round(theirs / before["s"], 2),
            baseline_compile_s=before["compile_s"],
            baseline_plan=before["plan"],
            baseline_cv=before["cv"],
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=MODELS)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--naive", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help="a .npz of x and y to time on (default: the shapes written anew)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--baseline", metavar="REV", help="also time the trial with foldsweep at this git revision")
    parser.add_argument(
        "--train",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a train setting of the trial's spec (YAML value)",
    )
    args = parser.parse_args(argv)
    import yaml

    if args.naive:
        naive(args.naive, args.data, epochs=args.epochs, batch_size=args.batch_size)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        data_path = args.data.resolve() if args.data else write_images(directory / "shapes.npz")
        train = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.train)}
        baseline = export(args.baseline, directory / "baseline") if args.baseline else None
        for model in args.model or MODELS:
            rows.append(
                row(
                    model,
                    directory,
                    data_path,
                    epochs=args.epochs,
                    batch_size=args.batch_size,
                    train=train,
                    baseline=baseline,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    print(f"{'model':14} {'foldsweep s':>11} {'naive s':>8} {'faster by':>9} {'compile s':>9}  plan")
    for r in rows:
        print(
            f"{r['model']:14} {r['foldsweep_s']:>11} {r['naive_s']:>8} {r['faster_by']:>8}x {r['compile_s']!s:>9}  {r['plan']}"
        )
        if "baseline_s" in r:
            print(
                f"{'  ' + args.baseline[:12]:14} {r['baseline_s']:>11} {'':>8} {r['baseline_faster_by']:>8}x "
                f"{r['baseline_compile_s']!s:>9}  {r['baseline_plan']}"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
