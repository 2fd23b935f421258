"""A quick run of benchmarks.suite_pools (--quick: what its table holds, not its numbers)."""

from __future__ import annotations

import pytest

from benchmarks import suite_pools

pytestmark = pytest.mark.e2e  # it runs the benchmark's own processes


def test_suite_pools_runs_two_pytest_processes_with_each_pool_size(capsys):
    suite_pools.main(["--quick"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["pools", "machine", "CPU-s", "wall", "s"]
    assert [line.split()[0] for line in lines[1:]] == ["default", "shared"]
    assert all(float(value) > 0 for line in lines[1:] for value in line.split()[1:])
