"""The pytest processes' thread pools: TensorFlow's default against a trial's of their cores.

`make test` runs two pytest workers on two cores, and each trains models in its own process
(test_stacked, test_fold_engine_fit_parity, ...). Beside other workers, the suite's conftest gives
a process the pools `plan_threads` gives a trial of its share of the cores (two cores, two
workers: one thread per pool, the pools of the suite's own one-CPU trials); alone, TensorFlow's
default, a thread per core in each pool. This runs the in-process training modules in two pytest
processes at once, as the two workers do, first as processes that each think they run alone (the
default pools), then as two workers of one run (the conftest's pools), and prints the machine's
CPU time and the wall time of each round:

    .venv/bin/python -m benchmarks.suite_pools [--rounds 2] [--quick]

``--quick``: one small test per process, one round (a check that it runs, not a measurement).

The machine's CPU counts everything running on it, so measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.suite_cpu import machine_busy_seconds

REPO = Path(__file__).resolve().parents[1]
# One pytest process each, as the xdist workers would get them: the largest module alone.
SHARES = (
    ["tests/test_stacked.py"],
    ["tests/test_fold_engine_fit_parity.py", "tests/test_trainer_nan.py", "tests/test_fold_engine.py"],
)
# A check that the rounds run and are measured: one small test per process, no training.
QUICK_SHARES = (
    ["tests/test_significance.py::test_the_selection_records_every_cv_score_of_one_epoch_for_all_replicas"],
    ["tests/test_significance.py::test_identical_scores_are_tied_and_a_constant_advantage_is_not"],
)
# What pytest-xdist tells each worker of the run, and so what the conftest sizes the pools by.
WORKER_COUNT_VARIABLE = "PYTEST_XDIST_WORKER_COUNT"


def one_round(worker_count: str | None, shares: tuple[list[str], ...] = SHARES) -> tuple[float, float]:
    """Machine CPU-s and wall s of ``shares`` at once, each a pytest process of its modules."""
    # Nothing of a pytest run this one is started from (its xdist worker's name and count).
    environment = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    if worker_count is not None:
        environment[WORKER_COUNT_VARIABLE] = worker_count
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    busy, start = machine_busy_seconds(), time.monotonic()
    processes = [
        subprocess.Popen(
            [*command, *modules], cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for modules in shares
    ]
    for process in processes:
        output, _ = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"the tests failed ({WORKER_COUNT_VARIABLE}={worker_count}):\n{output[-3000:]}")
    return machine_busy_seconds() - busy, time.monotonic() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="one small test per process, one round")
    arguments = parser.parse_args(argv)
    shares, rounds = (QUICK_SHARES, 1) if arguments.quick else (SHARES, arguments.rounds)
    # Each process alone (TensorFlow's default pools), then as the workers of one run.
    pools = {"default": None, "shared": str(len(shares))}
    print(f"{'pools':>8} {'machine CPU-s':>13} {'wall s':>7}")
    for _ in range(rounds):
        for name, worker_count in pools.items():
            cpu, wall = one_round(worker_count, shares)
            print(f"{name:>8} {cpu:13.1f} {wall:7.1f}", flush=True)


if __name__ == "__main__":
    main()
