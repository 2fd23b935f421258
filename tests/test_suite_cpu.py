"""benchmarks.suite_cpu: each test's CPU time, from a pytest run of its own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from helpers import REPO

from benchmarks.suite_cpu import summarize

pytest_plugins = ["pytester"]

BURN = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end:\n    pass\n"


def test_each_test_gets_the_cpu_of_its_process_and_of_the_subprocesses_it_ran(pytester, monkeypatch):
    output = pytester.path / "cpu.jsonl"
    output.write_text(json.dumps({"test": "test_inner.py::an_earlier_run", "machine_cpu_s": 9.0}) + "\n")
    monkeypatch.setenv("SUITE_CPU_OUT", str(output))
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the inner pytest runs in a directory of its own
    pytester.makepyfile(
        test_inner=textwrap.dedent(f"""
        import subprocess, sys

        def test_burns_here():
            exec({BURN!r})

        def test_burns_in_a_subprocess():
            subprocess.run([sys.executable, "-c", {BURN!r}], check=True)
        """)
    )
    result = pytester.runpytest_subprocess("-p", "benchmarks.suite_cpu")
    result.assert_outcomes(passed=2)
    lines = output.read_text().splitlines()
    records = {record["test"].split("::")[1]: record for record in map(json.loads, lines)}
    assert len(lines) == 2 and set(records) == {"test_burns_here", "test_burns_in_a_subprocess"}, "this run's only"
    here, there = records["test_burns_here"], records["test_burns_in_a_subprocess"]
    assert here["pytest_cpu_s"] >= 0.29 and here["reaped_children_cpu_s"] < 0.05
    assert there["reaped_children_cpu_s"] >= 0.29 and there["pytest_cpu_s"] < 0.25
    assert here["machine_cpu_s"] >= 0.25 and there["machine_cpu_s"] >= 0.25


def test_it_refuses_tests_that_run_side_by_side(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makepyfile(test_inner="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "benchmarks.suite_cpu", "-n", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*run it in one process (TEST_WORKERS=0 make test, or -n 0), got -n 2"])


def test_the_summary_ranks_modules_and_tests_by_the_machines_cpu():
    records = [
        {"test": "tests/test_a.py::one", "wall_s": 2.0, "machine_cpu_s": 3.0, "pytest_cpu_s": 1.0},
        {"test": "tests/test_b.py::two", "wall_s": 1.0, "machine_cpu_s": 5.0, "pytest_cpu_s": 0.5},
        {"test": "tests/test_a.py::three", "wall_s": 1.0, "machine_cpu_s": 4.0, "pytest_cpu_s": 4.0},
    ]
    lines = summarize(records, top=2).splitlines()
    assert lines[0].startswith("3 tests, 12 CPU-s of the machine, 6 s on two cores")
    modules = [line.split()[-1] for line in lines[3:5]]
    assert modules == ["tests/test_a.py", "tests/test_b.py"]  # 7 CPU-s, then 5
    assert lines[3].split()[:3] == ["7.0", "5.0", "2"]
    tests = [line.split()[-1] for line in lines[-2:]]
    assert tests == ["tests/test_b.py::two", "tests/test_a.py::three"]  # the top 2 only


def test_the_summary_of_a_file_that_is_missing_or_empty_is_one_line_and_exit_2(tmp_path):
    missing = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite_cpu", str(tmp_path / "none.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.startswith(f"{tmp_path / 'none.jsonl'}: cannot read the plugin's records (")
    assert "Traceback" not in missing.stderr and 'PYTEST_ARGS="-p benchmarks.suite_cpu"' in missing.stderr
    (tmp_path / "empty.jsonl").write_text("\n")
    empty = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite_cpu", str(tmp_path / "empty.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert (empty.returncode, empty.stderr) == (2, f"{tmp_path / 'empty.jsonl'}: no tests recorded in it\n")
