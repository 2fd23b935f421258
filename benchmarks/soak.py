"""Soak: hundreds of tiny XLA-compiled trials on 2 concurrent workers, through the real sweep.

Every XLA-compiled trial leaves its programs mapped in its worker process, and Linux stops a
process at `vm.max_map_count` mappings; workers retire before that (`pipeline.engine.lifespan`). This
runs `--trials` tiny trials (MNIST-1D, a one-layer CNN, 1 epoch, 3 folds, XLA on) and prints,
every `--every` trials: the trials done, the worker processes started so far, the peak worker
RSS and mapping count, and the driver's RSS. It ends by checking MLflow: every trial FINISHED,
exactly once.

    .venv/bin/python -m benchmarks.soak [--trials 300] [--every 50] [--max-trials-per-worker auto]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import yaml  # noqa: E402

from pipeline.engine.lifespan import map_limit  # noqa: E402
from pipeline.inputs.spec import load_spec  # noqa: E402
from pipeline.sweep import prepare, run_sweep  # noqa: E402
from pipeline.records.tracking import Tracker  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def status_kb(pid: int | str, field: str) -> int:
    """A /proc/PID/status field in KiB (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--max-trials-per-worker", default="auto")
    args = parser.parse_args()
    if args.trials < 1 or args.every < 1:
        parser.error(f"--trials and --every must be at least 1, got {args.trials} and {args.every}")
    directory = Path(tempfile.mkdtemp(prefix="foldsweep-soak-"))
    per_worker = args.max_trials_per_worker if args.max_trials_per_worker == "auto" else int(args.max_trials_per_worker)
    spec = {
        "name": "soak", "experiment": f"{REPO / 'experiments' / 'mnist1d_cnn.py'}:build",
        "dataset": {"name": "mnist1d", "num_samples": 600}, "cv": {"splitter": "stratified", "n_splits": 3},
        "search": {"num_samples": args.trials, "seed": 0, "space": {
            "conv_layers": 1, "filters": 16, "kernel_size": {"choice": [3, 5, 7]}, "dropout": 0.0,
            "batch_size": 32, "learning_rate": {"loguniform": [1e-4, 1e-2]}}},
        "train": {"epochs": 1, "jit_compile": True, "refit": False},
        "resources": {"cpu": 1, "max_concurrent": 2, "max_trials_per_worker": per_worker},
        "tracking": {"uri": f"sqlite:///{directory / 'mlflow.db'}"},
    }
    (directory / "soak.yaml").write_text(yaml.safe_dump(spec))
    os.chdir(directory)
    prepared = prepare(load_spec(directory / "soak.yaml"))
    workers: set[str] = set()
    peak = {"rss_kb": 0, "maps": 0}
    done = []
    started = time.perf_counter()
    print(f"soak: {args.trials} trials, 2 concurrent workers, vm.max_map_count {map_limit()}, store {directory}",
          flush=True)
    print(f"{'trials':>7} {'workers':>8} {'peak worker RSS MB':>19} {'peak worker maps':>17} {'driver RSS MB':>14} "
          f"{'elapsed s':>10}", flush=True)

    def on_trial_done(record) -> None:
        done.append(record.status)
        pid = record.tags.get("pid", "")
        workers.add(pid)
        peak["maps"] = max(peak["maps"], int(record.metrics.get("worker_maps", 0)))
        for worker in workers:  # peak RSS of the workers still alive (VmHWM: the high-water mark)
            peak["rss_kb"] = max(peak["rss_kb"], status_kb(worker, "VmHWM"))
        if len(done) % args.every == 0 or len(done) == args.trials:
            print(f"{len(done):>7} {len(workers):>8} {peak['rss_kb'] / 1024:>19.0f} {peak['maps']:>17} "
                  f"{status_kb('self', 'VmRSS') / 1024:>14.0f} {time.perf_counter() - started:>10.0f}", flush=True)

    run_sweep(prepared, on_trial_done=on_trial_done, notify=print)
    records = Tracker(prepared.tracking_uri).trial_records(Tracker(prepared.tracking_uri).find_sweep("soak").run_id)
    finished = [record for record in records if record.state == "FINISHED"]
    print(f"MLflow: {len(records)} trial runs, {len(finished)} FINISHED, {len({r.trial_id for r in records})} distinct "
          f"trials; {len(workers)} worker processes; statuses {sorted(set(done))}")
    if len(records) != args.trials or len(finished) != args.trials or len({r.trial_id for r in records}) != args.trials:
        raise SystemExit("soak: not every trial FINISHED exactly once")


if __name__ == "__main__":
    main()
