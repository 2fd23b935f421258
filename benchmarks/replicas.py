"""Repeated CV: what more replicas cost. One trial's training throughput at 3 replicas (3 folds)
against 15 (5 repeats x 3 folds; --replicas), fused, side by side in one run.

samples/s counts the training samples of all replicas per second (compilation excluded, as in
benchmarks.cv_throughput, whose fresh-process measurement this reuses); ``s/replica-epoch`` is an
epoch's wall time divided by the replicas it trains, the cost of one more replica. Each
(batch size, layout) pair is measured 3 and 15 replicas in turn, --repeats times; the ratio is the
median of each round's paired ratio, so a slow spell of the machine cancels out. ``fused`` is the
layout a sweep picks for --cpus; ``stacked`` and ``side`` force one.

    .venv/bin/python -m benchmarks.replicas [--batch-sizes 8,64] [--layouts fused,stacked,side] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cv_throughput import N_SPLITS, measure_apart, median_ratio

LAYOUTS = ("fused", "stacked", "side")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="8,64")
    parser.add_argument(
        "--replicas",
        default="3,15",
        help=f"comma list of multiples of {N_SPLITS} (folds x repeats); the first is the baseline",
    )
    parser.add_argument("--layouts", default="fused,stacked,side", help="comma list of " + ", ".join(LAYOUTS))
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per measurement, after the compiling one")
    parser.add_argument("--repeats", type=int, default=2, help="measurements per setting, interleaved")
    parser.add_argument("--cpus", type=int, default=os.cpu_count(), help="the trial's resources.cpu")
    parser.add_argument("--full", action="store_true", help="all 4,000 MNIST-1D training samples (default 2,400)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    unknown = [layout for layout in layouts if layout not in LAYOUTS]
    if unknown or args.epochs < 1 or args.repeats < 1:
        raise SystemExit(f"--layouts: unknown {', '.join(unknown)}" if unknown else "--epochs/--repeats: at least 1")
    counts = [int(count) for count in args.replicas.split(",")]
    if any(count < N_SPLITS or count % N_SPLITS for count in counts):
        raise SystemExit(f"--replicas: multiples of {N_SPLITS}, got {args.replicas}")
    rows = []
    print(
        f"{'batch':>6}{'layout':>9}{'replicas':>10}{'samples/s':>11}{'s/replica-epoch':>17}{'vs ' + str(counts[0]):>7}"
        f"{'compile_s':>11}{'peak RSS MB':>13}  plan",
        flush=True,
    )
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        for layout in layouts:
            runs: dict[int, list[dict[str, Any]]] = {replicas: [] for replicas in counts}
            for _ in range(args.repeats):
                for replicas in counts:
                    measurement = argparse.Namespace(
                        quick=not args.full,
                        dropout=False,
                        hp=[],
                        cpus=args.cpus,
                        epochs=args.epochs,
                        cv_repeats=replicas // N_SPLITS,
                    )
                    runs[replicas].append(measure_apart(measurement, "mnist1d", batch_size, layout))
            train_per_replica = (4000 if args.full else 2400) * (N_SPLITS - 1) / N_SPLITS
            for replicas in counts:
                rate = float(np.median([run["rate"] for run in runs[replicas]]))
                versus = median_ratio(runs[replicas], runs[counts[0]])
                row = {
                    "dataset": "mnist1d",
                    "batch_size": batch_size,
                    "layout": layout,
                    "replicas": replicas,
                    "samples_per_s": round(rate, 1),
                    "runs": [round(run["rate"], 1) for run in runs[replicas]],
                    "s_per_replica_epoch": round(train_per_replica / rate, 4),
                    "vs_first": round(versus, 3),
                    "compile_s": round(float(np.median([run["compile_s"] for run in runs[replicas]])), 2),
                    "peak_rss_mb": round(max(run["peak_rss_mb"] for run in runs[replicas]), 1),
                    "plan": runs[replicas][0].get("fusion", ""),
                    "cpus": args.cpus,
                }
                rows.append(row)
                print(
                    f"{batch_size:>6}{layout:>9}{replicas:>10}{rate:>11.0f}{row['s_per_replica_epoch']:>17.3f}"
                    f"{versus:>6.2f}x{row['compile_s']:>11.1f}{row['peak_rss_mb']:>13.0f}  {row['plan']}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
