"""The pytest process's thread pools: TensorFlow's default against a one-CPU trial's.

`make test` runs two pytest workers on two cores, and each trains models in its own process
(test_fused, test_fit_parity, ...). The suite's conftest gives those processes the pools that
`plan_threads` gives the one-CPU trials of its sweeps; TensorFlow's default is a thread per core
in each pool. This runs the in-process training modules in two pytest processes at once, as the
two workers do, with each pool size in turn, and prints the machine's CPU time and the wall time
of each round:

    .venv/bin/python -m benchmarks.suite_pools [--rounds 2]

The machine's CPU counts everything running on it, so measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.suite_cpu import machine_busy_seconds

REPO = Path(__file__).resolve().parents[1]
POOLS_VARIABLE = "SUITE_POOLS"
# One pytest process each, as the xdist workers would get them: the largest module alone.
SHARES = (["tests/test_fused.py"], ["tests/test_fit_parity.py", "tests/test_nan.py", "tests/test_training.py"])


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """As a plugin with SUITE_POOLS=default: back to TensorFlow's default pools, after the
    conftest has set its own (TensorFlow has not started yet)."""
    if os.environ.get(POOLS_VARIABLE) == "default" and "tensorflow" in sys.modules:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(0)
        tf.config.threading.set_inter_op_parallelism_threads(0)


def one_round(pools: str) -> tuple[float, float]:
    """Machine CPU-s and wall s of both shares at once."""
    environment = {**os.environ, POOLS_VARIABLE: pools}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.suite_pools", "-p", "no:cacheprovider",
               "-o", "addopts="]
    busy, start = machine_busy_seconds(), time.monotonic()
    shares = [subprocess.Popen([*command, *modules], cwd=REPO, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for modules in SHARES]
    for share in shares:
        output, _ = share.communicate()
        if share.returncode != 0:
            raise SystemExit(f"the tests failed with {pools} pools:\n{output[-3000:]}")
    return machine_busy_seconds() - busy, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    arguments = parser.parse_args()
    print(f"{'pools':>9} {'machine CPU-s':>13} {'wall s':>7}")
    for _ in range(arguments.rounds):
        for pools in ("default", "one-CPU"):
            cpu, wall = one_round(pools)
            print(f"{pools:>9} {cpu:13.1f} {wall:7.1f}", flush=True)


if __name__ == "__main__":
    main()
