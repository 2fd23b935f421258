"""The whole user-level job: 12 configs x 3 folds on MNIST-1D, `foldsweep run` vs the naive loop.

The naive loop is what the researcher runs today: for each config, for each fold, a fresh model
and plain `model.fit` on NumPy arrays, one after another. `foldsweep run` is timed as a command,
start-up (Ray, MLflow) included. Wall clock of both and the ratio, printed and as JSON.

    .venv/bin/python -m benchmarks.sweep_wallclock [--epochs N] [--quick] [--json PATH]

``--quick``: 1 config (filters 16 at batch 64) and 1 epoch, a check that it runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import yaml  # noqa: E402

from benchmarks.common import mnist1d, naive_fold_fit  # noqa: E402
from pipeline.inputs.datasets import data_dir  # noqa: E402
from pipeline.inputs.folds import make_folds  # noqa: E402
from pipeline.inputs.hypermodel import build_model, load_builder  # noqa: E402
from pipeline.inputs.spec import CVSpec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = REPO / "experiments" / "mnist1d_cnn.py"
GRID: dict[str, list[int] | list[float]] = {
    "batch_size": [16, 32, 64],
    "learning_rate": [0.001, 0.003],
    "filters": [16, 32],
}
QUICK_GRID: dict[str, list[int] | list[float]] = {"batch_size": [64], "learning_rate": [0.003], "filters": [16]}
FIXED = {"conv_layers": 2, "kernel_size": 5, "dropout": 0.1}


def configs(grid: dict[str, list[int] | list[float]]) -> list[dict]:
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def naive_loop(epochs: int, grid: dict[str, list[int] | list[float]]) -> tuple[float, list[float]]:
    dataset = mnist1d()
    folds = make_folds(CVSpec(splitter="stratified", n_splits=3, seed=0), dataset).folds
    build_fn = load_builder(EXPERIMENT, "build")
    started = time.perf_counter()
    scores = []
    for config in configs(grid):
        model_values = {**FIXED, "filters": config["filters"]}
        accuracies = []
        for k, fold in enumerate(folds):
            _, accuracy = naive_fold_fit(
                lambda: build_model(build_fn, model_values),
                dataset.x[fold.train],
                dataset.y[fold.train],
                dataset.x[fold.val],
                dataset.y[fold.val],
                batch_size=config["batch_size"],
                epochs=epochs,
                learning_rate=config["learning_rate"],
                seed=k,
            )
            accuracies.append(accuracy)
        scores.append(sum(accuracies) / len(accuracies))
    return time.perf_counter() - started, scores


def write_spec(epochs: int, grid: dict[str, list[int] | list[float]], workdir: Path) -> Path:
    """The sweep's spec, written in ``workdir``: the grid over the naive loop's configs and folds."""
    spec = {
        "name": "wallclock",
        "experiment": f"{EXPERIMENT}:build",
        "dataset": "mnist1d",
        "cv": {"splitter": "stratified", "n_splits": 3, "seed": 0},
        "search": {
            "num_samples": 1,
            "seed": 0,
            "space": {**{key: {"grid": values} for key, values in grid.items()}, **FIXED},
        },
        "train": {"epochs": epochs, "metric": "accuracy", "mode": "max"},
        "resources": {"cpu": 1},
        "tracking": {"uri": f"sqlite:///{workdir / 'mlflow.db'}"},
    }
    path = workdir / "wallclock.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def foldsweep_run(epochs: int, grid: dict[str, list[int] | list[float]], workdir: Path) -> float:
    path = write_spec(epochs, grid, workdir)
    command = [str(Path(sys.executable).parent / "foldsweep"), "run", str(path)]
    started = time.perf_counter()
    subprocess.run(
        command,
        check=True,
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "FOLDSWEEP_DATA_DIR": str(data_dir())},
    )
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="1 config and 1 epoch")
    parser.add_argument("--json", type=Path, help="also write the result as JSON to this path")
    args = parser.parse_args(argv)
    grid, epochs = (QUICK_GRID, 1) if args.quick else (GRID, args.epochs)
    mnist1d()  # generate the cache first so neither side pays for it
    with tempfile.TemporaryDirectory() as workdir:
        foldsweep_s = foldsweep_run(epochs, grid, Path(workdir))
    naive_s, _ = naive_loop(epochs, grid)
    result = {
        "configs": len(configs(grid)),
        "folds": 3,
        "epochs": epochs,
        "naive_s": round(naive_s, 1),
        "foldsweep_s": round(foldsweep_s, 1),
        "ratio": round(naive_s / foldsweep_s, 2),
    }
    print(
        f"{result['configs']} configs x 3 folds x {epochs} epochs on MNIST-1D: naive loop "
        f"{naive_s:.0f} s, foldsweep run {foldsweep_s:.0f} s -> {result['ratio']:.2f}x faster"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
