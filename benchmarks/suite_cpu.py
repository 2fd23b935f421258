"""What each test costs in CPU time, to see where `make test`'s time goes.

On two cores both are busy for the whole suite, so its wall time is its CPU time over two, and
pytest's durations mislead: a test beside the other xdist worker's takes longer without costing
more, and a test's Ray workers and subprocesses are not in its own process's CPU time. Run the
suite in one process with this plugin and each test gets the CPU time of the whole machine while
it ran (its Ray workers, Ray's own processes, its subprocesses and servers), of the pytest
process, and of the subprocesses it reaped:

    TEST_WORKERS=0 make test PYTEST_ARGS="-p benchmarks.suite_cpu"        # writes suite_cpu.jsonl
    .venv/bin/python -m benchmarks.suite_cpu [suite_cpu.jsonl] [--top 20]   # by module, then by test

Set SUITE_CPU_OUT for another file. The machine's CPU counts everything running on it, so
measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

OUTPUT_VARIABLE = "SUITE_CPU_OUT"
DEFAULT_OUTPUT = "suite_cpu.jsonl"
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal: not idle, not iowait


def machine_busy_seconds() -> float:
    with open("/proc/stat") as stat:
        ticks = [int(field) for field in stat.readline().split()[1:]]
    return sum(ticks[i] for i in BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")


def _process_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def pytest_configure(config: pytest.Config) -> None:
    """Refuse xdist workers: beside another test, the machine's CPU time is no longer this test's."""
    workers = getattr(config.option, "numprocesses", None)
    if workers not in (None, 0):
        raise pytest.UsageError(
            f"-p benchmarks.suite_cpu measures the whole machine around each test, so the tests must "
            f"run one at a time: run it in one process (TEST_WORKERS=0 make test, or -n 0), got "
            f"-n {workers}"
        )
    # Each test appends its record as it ends; a run starts the file afresh, or the ranking would
    # add up this run's tests and an earlier run's.
    Path(os.environ.get(OUTPUT_VARIABLE, DEFAULT_OUTPUT)).write_text("")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Around set-up, call and teardown, so a fixture's cost lands on the first test that uses it."""
    start = (
        time.monotonic(),
        machine_busy_seconds(),
        _process_seconds(resource.RUSAGE_SELF),
        _process_seconds(resource.RUSAGE_CHILDREN),
    )
    yield
    wall, machine, own, children = (
        time.monotonic() - start[0],
        machine_busy_seconds() - start[1],
        _process_seconds(resource.RUSAGE_SELF) - start[2],
        _process_seconds(resource.RUSAGE_CHILDREN) - start[3],
    )
    record = {
        "test": item.nodeid,
        "wall_s": round(wall, 2),
        "machine_cpu_s": round(machine, 2),
        "pytest_cpu_s": round(own, 2),
        "reaped_children_cpu_s": round(children, 2),
    }
    with open(os.environ.get(OUTPUT_VARIABLE, DEFAULT_OUTPUT), "a") as output:
        output.write(json.dumps(record) + "\n")


def summarize(records: list[dict[str, Any]], top: int) -> str:
    total = sum(record["machine_cpu_s"] for record in records)
    lines = [
        f"{len(records)} tests, {total:,.0f} CPU-s of the machine, {total / 2:,.0f} s on two cores packed "
        "perfectly; the pytest process's share "
        f"{sum(record['pytest_cpu_s'] for record in records):,.0f} CPU-s",
        "",
        f"{'machine CPU-s':>13} {'pytest CPU-s':>12} {'tests':>5}  module",
    ]
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for record in records:
        module = modules[record["test"].split("::")[0]]
        module[0] += record["machine_cpu_s"]
        module[1] += record["pytest_cpu_s"]
        module[2] += 1
    for name, (machine, own, count) in sorted(modules.items(), key=lambda item: -item[1][0]):
        lines.append(f"{machine:13.1f} {own:12.1f} {count:5d}  {name}")
    lines += ["", f"{'machine CPU-s':>13} {'pytest CPU-s':>12} {'wall s':>7}  test (the {top} costliest)"]
    for record in sorted(records, key=lambda record: -record["machine_cpu_s"])[:top]:
        lines.append(
            f"{record['machine_cpu_s']:13.1f} {record['pytest_cpu_s']:12.1f} {record['wall_s']:7.1f}  {record['test']}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=os.environ.get(OUTPUT_VARIABLE, DEFAULT_OUTPUT))
    parser.add_argument("--top", type=int, default=20)
    arguments = parser.parse_args()
    try:
        records = [json.loads(line) for line in Path(arguments.path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as error:
        parser.exit(
            2,
            f"{arguments.path}: cannot read the plugin's records ({error}); write them with "
            f'TEST_WORKERS=0 make test PYTEST_ARGS="-p benchmarks.suite_cpu"\n',
        )
    if not records:
        parser.exit(2, f"{arguments.path}: no tests recorded in it\n")
    print(summarize(records, arguments.top))


if __name__ == "__main__":
    main()
