"""What the persistent XLA compile cache saves on a sweep whose programs repeat, in one run.

The same XLA sweep (12 configs: 3 learning rates x clipping none/norm x batch sizes 16 and 32,
3 folds; 4 distinct programs per fold) runs three times as `foldsweep run`, each in a fresh
working directory: with the cache off, with an empty cache (cold), and again with the cache the
cold run filled (warm). For each: wall clock, total `compile_s` over the trials, and the cache
hits and misses the trials recorded in MLflow.

    .venv/bin/python -m benchmarks.compile_cache [--epochs N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import yaml  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXPERIMENT = REPO / "experiments" / "mnist1d_cnn.py"


def spec(epochs: int, workdir: Path) -> Path:
    document = {
        "name": "compile-cache",
        "experiment": f"{EXPERIMENT}:build",
        "dataset": "mnist1d",
        "cv": {"splitter": "stratified", "n_splits": 3, "seed": 0},
        "search": {"num_samples": 1, "seed": 0, "space": {
            "learning_rate": {"grid": [0.001, 0.002, 0.003]}, "clipping": {"grid": ["none", "norm"]},
            "clip_threshold": 1.0, "batch_size": {"grid": [16, 32]},
            # No dropout: random layers run without XLA on CPU (pipeline.contract.plan).
            "conv_layers": 2, "filters": 32, "kernel_size": 5, "dropout": 0.0}},
        "train": {"epochs": epochs, "metric": "accuracy", "mode": "max", "jit_compile": True, "refit": False},
        "resources": {"cpu": 1, "max_concurrent": 2},
        "tracking": {"uri": f"sqlite:///{workdir / 'mlflow.db'}"},
    }
    path = workdir / "compile_cache.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def run_sweep(epochs: int, *, cache_dir: Path | None) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        environment = {**os.environ, "FOLDSWEEP_DATA_DIR": str(REPO / "data")}
        if cache_dir is None:
            environment["FOLDSWEEP_COMPILE_CACHE"] = "off"
        else:
            environment["FOLDSWEEP_COMPILE_CACHE_DIR"] = str(cache_dir)
        command = [str(Path(sys.executable).parent / "foldsweep"), "run", str(spec(epochs, workdir))]
        started = time.perf_counter()
        subprocess.run(command, check=True, cwd=workdir, stdout=subprocess.DEVNULL, env=environment)
        wall_s = time.perf_counter() - started
        return {"wall_s": round(wall_s, 1), **trial_totals(f"sqlite:///{workdir / 'mlflow.db'}")}


def trial_totals(uri: str) -> dict:
    import mlflow

    client = mlflow.MlflowClient(uri)
    totals = {"trials": 0, "compile_s": 0.0, "hits": 0, "misses": 0}
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id]):
            metrics = run.data.metrics
            if "compile_s" not in metrics:
                continue
            totals["trials"] += 1
            totals["compile_s"] += metrics["compile_s"]
            totals["hits"] += int(metrics.get("compile_cache_hits", 0))
            totals["misses"] += int(metrics.get("compile_cache_misses", 0))
    totals["compile_s"] = round(totals["compile_s"], 1)
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the result as JSON to this path")
    args = parser.parse_args(argv)
    from benchmarks.common import mnist1d

    mnist1d()  # generate the dataset first so no run pays for it
    with tempfile.TemporaryDirectory() as cache:
        result = {"off": run_sweep(args.epochs, cache_dir=None),
                  "cold": run_sweep(args.epochs, cache_dir=Path(cache)),
                  "warm": run_sweep(args.epochs, cache_dir=Path(cache))}
    for name, row in result.items():
        print(f"{name:>4}: wall {row['wall_s']:6.1f} s  compile_s {row['compile_s']:6.1f}  hits {row['hits']:3d}  "
              f"misses {row['misses']:3d}  ({row['trials']} trials)")
    off = result["off"]
    for name in ("cold", "warm"):
        row = result[name]
        print(f"{name} vs off: compile {off['compile_s'] / max(row['compile_s'], 1e-9):.2f}x lower, "
              f"wall clock {off['wall_s'] / row['wall_s']:.2f}x faster")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
