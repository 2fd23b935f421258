"""Soak: hundreds of tiny XLA-compiled trials on 2 concurrent workers, through the real sweep.

A worker Ray Tune reuses for trial after trial keeps what each trial leaves behind: its XLA
programs mapped (Linux stops a process at `vm.max_map_count` mappings) and memory; workers
release what can be released between trials and retire before either limit
(`pipeline.engine.lifespan`). This runs `--trials` tiny trials (MNIST-1D, a CNN, 1 epoch, 3
folds, XLA on) whose hyperparameters vary over one architecture (`--mode hp`, the common case:
one program for all) or whose architecture varies too (`--mode arch`: kernel size, filters and
depth, 18 programs), and prints, every `--every` trials: the trials done, the worker processes
started so far, the peak worker RSS and mapping count, the RSS slope (MiB a trial adds to its
worker, after each worker's first `SETTLING` trials: the median over workers of a line fitted to
its RSS after each trial) and the driver's RSS. It ends by checking MLflow: every trial FINISHED,
exactly once.

    .venv/bin/python -m benchmarks.soak [--trials 300] [--every 50] [--mode hp | arch]
        [--max-trials-per-worker auto | N] [--max-worker-memory auto | MB]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import yaml  # noqa: E402

from pipeline.checks import prepare  # noqa: E402
from pipeline.contract.results import WORKER_MAPS, WORKER_PID, WORKER_RSS, WORKER_TRIALS  # noqa: E402
from pipeline.engine.lifespan import map_limit  # noqa: E402
from pipeline.inputs.spec import load_spec  # noqa: E402
from pipeline.records.tracking import Tag, Tracker, TrialRecord  # noqa: E402
from pipeline.sweep import SweepEvents, run_sweep  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# A worker's first trials load TensorFlow's lazily built parts: its slope is fitted after them.
SETTLING = 5
SPACES = {
    "hp": {
        "conv_layers": 1,
        "filters": 16,
        "kernel_size": 5,
        "dropout": 0.0,
        "batch_size": 32,
        "learning_rate": {"loguniform": [1e-4, 1e-2]},
    },
    "arch": {
        "conv_layers": {"choice": [1, 2]},
        "filters": {"choice": [16, 32, 48]},
        "kernel_size": {"choice": [3, 5, 7]},
        "dropout": 0.0,
        "batch_size": 32,
        "learning_rate": {"loguniform": [1e-4, 1e-2]},
    },
}


def rss_slope(points: list[tuple[int, float]]) -> float | None:
    """MiB per trial of a least-squares line through (trial of its worker, RSS after it), past the
    worker's first SETTLING trials; None with fewer than two such points."""
    kept = [(trial, rss) for trial, rss in points if trial > SETTLING]
    if len(kept) < 2:
        return None
    n = len(kept)
    mean_x, mean_y = sum(x for x, _ in kept) / n, sum(y for _, y in kept) / n
    spread = sum((x - mean_x) ** 2 for x, _ in kept)
    return sum((x - mean_x) * (y - mean_y) for x, y in kept) / spread if spread else None


def worker_sample(record: TrialRecord) -> tuple[str, int, float, int]:
    """What a trial's record says of the worker process it ran in once it ended: its pid, how
    many trials it had run, its RSS (MB) and its memory mappings."""
    return (
        record.tags.get(Tag.of(WORKER_PID), ""),
        int(record.tags.get(Tag.of(WORKER_TRIALS), 0)),
        float(record.metrics.get(WORKER_RSS, 0.0)),
        int(record.metrics.get(WORKER_MAPS, 0)),
    )


def status_kb(pid: int | str, field: str) -> int:
    """A /proc/PID/status field in KiB (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--mode", choices=sorted(SPACES), default="hp")
    parser.add_argument("--max-trials-per-worker", default="auto")
    parser.add_argument("--max-worker-memory", default="auto")
    args = parser.parse_args(argv)
    if args.trials < 1 or args.every < 1:
        parser.error(f"--trials and --every must be at least 1, got {args.trials} and {args.every}")
    directory = Path(tempfile.mkdtemp(prefix="foldsweep-soak-"))
    per_worker = args.max_trials_per_worker if args.max_trials_per_worker == "auto" else int(args.max_trials_per_worker)
    memory = args.max_worker_memory if args.max_worker_memory == "auto" else int(args.max_worker_memory)
    spec = {
        "name": "soak",
        "experiment": f"{REPO / 'experiments' / 'mnist1d_cnn.py'}:build",
        "dataset": {"name": "mnist1d", "num_samples": 600},
        "cv": {"splitter": "stratified", "n_splits": 3},
        "search": {"num_samples": args.trials, "seed": 0, "space": SPACES[args.mode]},
        "train": {"epochs": 1, "jit_compile": True, "refit": False},
        "resources": {"cpu": 1, "max_concurrent": 2, "max_trials_per_worker": per_worker, "max_worker_memory": memory},
        "tracking": {"uri": f"sqlite:///{directory / 'mlflow.db'}"},
    }
    (directory / "soak.yaml").write_text(yaml.safe_dump(spec))
    os.chdir(directory)
    prepared = prepare(load_spec(directory / "soak.yaml"))
    workers: set[str] = set()
    peak = {"rss_kb": 0, "maps": 0}
    done = []
    started = time.perf_counter()
    print(
        f"soak: {args.trials} trials ({args.mode}), 2 concurrent workers, vm.max_map_count {map_limit()}, "
        f"max_worker_memory {memory}, store {directory}",
        flush=True,
    )
    print(
        f"{'trials':>7} {'workers':>8} {'peak worker RSS MB':>19} {'RSS MB/trial/worker':>20} {'peak worker maps':>17} "
        f"{'driver RSS MB':>14} {'elapsed s':>10}",
        flush=True,
    )
    rss_after: dict[str, list[tuple[int, float]]] = {}  # each worker's RSS after each of its trials

    def on_trial_done(record: TrialRecord) -> None:
        done.append(record.status)
        pid, trials, rss, maps = worker_sample(record)
        workers.add(pid)
        rss_after.setdefault(pid, []).append((trials, rss))
        peak["maps"] = max(peak["maps"], maps)
        # This row's peak: each trial's worker after it, and the high-water mark of the workers alive.
        peak["rss_kb"] = max(peak["rss_kb"], int(rss * 1024), *(status_kb(worker, "VmHWM") for worker in workers))
        if len(done) % args.every == 0 or len(done) == args.trials:
            slopes = sorted(slope for slope in map(rss_slope, rss_after.values()) if slope is not None)
            slope = f"{slopes[len(slopes) // 2]:.2f}" if slopes else "-"
            print(
                f"{len(done):>7} {len(workers):>8} {peak['rss_kb'] / 1024:>19.0f} {slope:>20} {peak['maps']:>17} "
                f"{status_kb('self', 'VmRSS') / 1024:>14.0f} {time.perf_counter() - started:>10.0f}",
                flush=True,
            )
            peak["rss_kb"] = 0

    run_sweep(prepared, SweepEvents(trial_done=on_trial_done, notify=print))
    records = Tracker(prepared.tracking_uri).trial_records(Tracker(prepared.tracking_uri).find_sweep("soak").run_id)
    finished = [record for record in records if record.state == "FINISHED"]
    print(
        f"MLflow: {len(records)} trial runs, {len(finished)} FINISHED, {len({r.trial_id for r in records})} distinct "
        f"trials; {len(workers)} worker processes; statuses {sorted(set(done), key=str)}"
    )
    if len(records) != args.trials or len(finished) != args.trials or len({r.trial_id for r in records}) != args.trials:
        raise SystemExit("soak: not every trial FINISHED exactly once")


if __name__ == "__main__":
    main()
