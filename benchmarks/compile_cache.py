"""What the persistent XLA compile cache saves on a sweep whose programs repeat, in one run.

The same XLA sweep (12 configs: 3 learning rates x clipping none/norm x batch sizes 16 and 32,
3 folds; 4 distinct programs per fold) runs three times as `foldsweep run`, each in a fresh
working directory: with the cache off, with an empty cache (cold), and again with the cache the
cold run filled (warm). For each: wall clock, total `compile_s` over the trials, and the cache
hits and misses the trials recorded in MLflow.

`--one-trial` runs instead one trial of 8 unrolled steps per launch (batch 8, 3 folds, MNIST-1D
1,500 samples), where what is left of a warm start is tracing and loading: its cold and warm
`compile_s`, and whether every fold's recorded losses are the same in the three runs.

    .venv/bin/python -m benchmarks.compile_cache [--one-trial] [--epochs N] [--quick] [--json PATH]

``--quick``: the one trial, 2 epochs, cold and warm only (a check that it runs: the warm run loads
what the cold one compiled, with the same losses).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import yaml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = REPO / "experiments" / "mnist1d_cnn.py"


def spec(epochs: int, workdir: Path, *, one_trial: bool = False) -> Path:
    document = (
        one_trial_document(epochs)
        if one_trial
        else {
            "name": "compile-cache",
            "experiment": f"{EXPERIMENT}:build",
            "dataset": "mnist1d",
            "cv": {"splitter": "stratified", "n_splits": 3, "seed": 0},
            "search": {
                "num_samples": 1,
                "seed": 0,
                "space": {
                    "learning_rate": {"grid": [0.001, 0.002, 0.003]},
                    "clipping": {"grid": ["none", "norm"]},
                    "clip_threshold": 1.0,
                    "batch_size": {"grid": [16, 32]},
                    # No dropout: random layers run without XLA on CPU (pipeline.contract.plan).
                    "conv_layers": 2,
                    "filters": 32,
                    "kernel_size": 5,
                    "dropout": 0.0,
                },
            },
            "train": {"epochs": epochs, "metric": "accuracy", "mode": "max", "jit_compile": True, "refit": False},
            "resources": {"cpu": 1, "max_concurrent": 2},
        }
    )
    document["tracking"] = {"uri": f"sqlite:///{workdir / 'mlflow.db'}"}
    path = workdir / "compile_cache.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def one_trial_document(epochs: int) -> dict:
    return {
        "name": "compile-cache-one-trial",
        "experiment": f"{EXPERIMENT}:build",
        "dataset": {"name": "mnist1d", "num_samples": 1875, "train_split": 0.8},  # 1,500 to cross-validate
        "cv": {"splitter": "stratified", "n_splits": 3, "seed": 0},
        "search": {
            "num_samples": 1,
            "seed": 0,
            "space": {
                "learning_rate": 0.001,
                "batch_size": 8,
                "conv_layers": 2,
                "filters": 32,
                "kernel_size": 5,
                "dropout": 0.0,
            },
        },
        "train": {
            "epochs": epochs,
            "metric": "accuracy",
            "mode": "max",
            "jit_compile": True,
            "refit": False,
            "steps_per_launch": 8,
        },
        "resources": {"cpu": 1, "max_concurrent": 1},
    }


def run_sweep(epochs: int, *, cache_dir: Path | None, one_trial: bool = False) -> dict[str, Any]:
    from pipeline.inputs.datasets import data_dir

    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        environment = {**os.environ, "FOLDSWEEP_DATA_DIR": str(data_dir())}
        if cache_dir is None:
            environment["FOLDSWEEP_COMPILE_CACHE"] = "off"
        else:
            environment["FOLDSWEEP_COMPILE_CACHE_DIR"] = str(cache_dir)
        command = [
            str(Path(sys.executable).parent / "foldsweep"),
            "run",
            str(spec(epochs, workdir, one_trial=one_trial)),
        ]
        started = time.perf_counter()
        subprocess.run(command, check=True, cwd=workdir, stdout=subprocess.DEVNULL, env=environment)
        wall_s = time.perf_counter() - started
        return {"wall_s": round(wall_s, 1), **trial_totals(f"sqlite:///{workdir / 'mlflow.db'}")}


def trial_totals(uri: str) -> dict[str, Any]:
    """Over the trials of the store's sweep that measured their compile time: how many, their
    summed ``compile_s``, the compile cache's hits and misses, and each fold's per-epoch losses by
    the trial's learning rate, batch size and clipping."""
    from pipeline.contract.results import COMPILE_CACHE_HITS, COMPILE_CACHE_MISSES, COMPILE_S
    from pipeline.records.tracking import Tracker

    tracker = Tracker(uri)
    measured = [record for record in tracker.trial_records(tracker.find_sweep().run_id) if COMPILE_S in record.metrics]
    fold_losses = {}
    for record in measured:
        trial = "".join(record.params.get(name, "") for name in ("learning_rate", "batch_size", "clipping"))
        fold_losses[trial] = {
            key: [value for _, value in tracker.metric_histories([record.run_id], key)[record.run_id]]
            for key in fold_loss_keys(record.metrics)
        }
    return {
        "trials": len(measured),
        "compile_s": round(sum(record.metrics[COMPILE_S] for record in measured), 1),
        "hits": sum(int(record.metrics.get(COMPILE_CACHE_HITS, 0)) for record in measured),
        "misses": sum(int(record.metrics.get(COMPILE_CACHE_MISSES, 0)) for record in measured),
        "fold_losses": fold_losses,
    }


def fold_loss_keys(metrics: Mapping[str, float]) -> list[str]:
    """The keys of each fold's training and validation loss a trial recorded (``split{k}_<loss>``)."""
    from pipeline.contract.results import FOLD_SCORE_NAMES, split_key

    losses = [name for name in FOLD_SCORE_NAMES if name.endswith("_loss")]
    keys: list[str] = []
    fold = 0
    while recorded := [split_key(fold, name) for name in losses if split_key(fold, name) in metrics]:
        keys += recorded
        fold += 1
    return sorted(keys)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="at least 2")
    parser.add_argument("--json", type=Path, help="also write the result as JSON to this path")
    parser.add_argument(
        "--one-trial", action="store_true", help="one trial of 8 steps per launch at batch 8 (MNIST-1D, 1,500 samples)"
    )
    parser.add_argument("--quick", action="store_true", help="--one-trial --epochs 2, one run with an empty cache")
    args = parser.parse_args(argv)
    if args.quick:
        args.one_trial, args.epochs = True, 2
    if args.epochs < 2:
        # A trial's compile_s is its first epoch's time beyond what a later epoch's rate makes of it.
        parser.error(f"--epochs: at least 2, for the trials to measure their compile_s; got {args.epochs}")
    from benchmarks.common import mnist1d

    mnist1d()  # generate the dataset first so no run pays for it
    result = {}
    with tempfile.TemporaryDirectory() as cache:
        if not args.quick:
            result["off"] = run_sweep(args.epochs, cache_dir=None, one_trial=args.one_trial)
        result["cold"] = run_sweep(args.epochs, cache_dir=Path(cache), one_trial=args.one_trial)
        if not args.quick:
            result["warm"] = run_sweep(args.epochs, cache_dir=Path(cache), one_trial=args.one_trial)
    for name, row in result.items():
        print(
            f"{name:>4}: wall {row['wall_s']:6.1f} s  compile_s {row['compile_s']:6.1f}  hits {row['hits']:3d}  "
            f"misses {row['misses']:3d}  ({row['trials']} trials)"
        )
    off, warm = result.get("off"), result.get("warm")
    if warm is not None:
        same = len({json.dumps(row["fold_losses"], sort_keys=True) for row in result.values()}) == 1
        print(f"every fold's recorded losses the same with the cache {', '.join(result)}: {'yes' if same else 'NO'}")
        print(f"warm compile_s / cold: {warm['compile_s'] / max(result['cold']['compile_s'], 1e-9):.2f}")
    if off is not None and warm is not None:
        for name in ("cold", "warm"):
            row = result[name]
            print(
                f"{name} vs off: compile {off['compile_s'] / max(row['compile_s'], 1e-9):.2f}x lower, "
                f"wall clock {off['wall_s'] / row['wall_s']:.2f}x faster"
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
