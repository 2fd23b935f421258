"""The files a command's processes read as they start are asked of the kernel ahead of them
(``pipeline.base.read_ahead``): the plan records, in import order, each loaded module's file and
the pages of each mapped library that the process touched; reading it ahead skips what changed
since; the commands that load TensorFlow start it, from a process of their own that is gone at
once. What it saves is measured in ``benchmarks/RESULTS.md`` (a page cache dropped by hand),
not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import psutil
import pytest
from typer.testing import CliRunner

import pipeline.cli
from pipeline.base import read_ahead
from pipeline.base.forking import THREADED_LIBRARIES
from pipeline.base.read_ahead import load_plan, record_read_ahead, start_read_ahead

REPO = Path(__file__).resolve().parents[1]


def test_a_plan_names_the_loaded_modules_in_import_order_and_the_touched_pages_of_each_library(tmp_path):
    plan_file = record_read_ahead(("json",), path=tmp_path / "plan.json")
    assert plan_file == tmp_path / "plan.json"
    plan = load_plan(plan_file)
    names = [name for name, _, _, _ in plan]
    assert len(names) == len(set(names))
    page = os.sysconf("SC_PAGE_SIZE")
    for name, size, mtime, ranges in plan:
        status = os.stat(name)
        assert (size, mtime) == (status.st_size, status.st_mtime_ns)
        for offset, length in ranges or []:
            assert offset % page == 0 and length > 0 and offset + length <= -(-size // page) * page

    # numpy's compiled core is mapped: its touched pages, not the whole file.
    core = next(name for name in names if "_multiarray_umath" in name)
    core_ranges = plan[names.index(core)][3]
    assert core_ranges and sum(length for _, length in core_ranges) <= os.stat(core).st_size
    # numpy's own library (numpy.libs/libscipy_openblas...) comes before numpy's first module,
    # which comes before the modules imported after it.
    first_numpy_module = min(i for i, name in enumerate(names) if "/numpy/" in name and name.endswith(".pyc"))
    libraries = [i for i, name in enumerate(names) if "numpy.libs/" in name]
    assert libraries and max(libraries) < first_numpy_module
    assert names.index(np.__cached__) < names.index(sys.modules["pipeline.base.read_ahead"].__cached__)


def test_reading_ahead_asks_for_the_files_as_recorded_and_skips_those_changed_or_gone(tmp_path):
    files = {name: tmp_path / name for name in ("kept", "grown", "gone")}
    for path in files.values():
        path.write_bytes(b"x" * 10_000)
    plan = [
        (str(path), path.stat().st_size, path.stat().st_mtime_ns, [(0, 4096)] if name == "kept" else None)
        for name, path in files.items()
    ]
    files["grown"].write_bytes(b"x" * 20_000)
    files["gone"].unlink()
    assert read_ahead.read_ahead(plan) == 1
    assert read_ahead.read_ahead(plan[:1] * 3) == 3


def test_a_plan_that_cannot_be_read_is_empty(tmp_path):
    assert load_plan(tmp_path / "none.json") == []
    (tmp_path / "broken.json").write_text("[[")
    assert load_plan(tmp_path / "broken.json") == []


def test_nothing_is_started_without_a_plan_or_where_tensorflow_or_ray_is_loaded(tmp_path, monkeypatch):
    plan = tmp_path / "plan.json"
    assert start_read_ahead(plan) is False
    plan.write_text(json.dumps([]))
    for library in THREADED_LIBRARIES:
        with monkeypatch.context() as patched:
            patched.setitem(sys.modules, library, types.ModuleType(library))
            assert start_read_ahead(plan) is False


def test_a_command_starts_the_reading_and_goes_on_with_no_child_left(tmp_path):
    plan = tmp_path / "plan.json"
    kept = tmp_path / "kept"
    kept.write_bytes(b"x" * 10_000)
    plan.write_text(json.dumps([[str(kept), kept.stat().st_size, kept.stat().st_mtime_ns, None]]))
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from pipeline.base.read_ahead import start_read_ahead\n"
        "started = start_read_ahead(Path(sys.argv[1]))\n"
        "try:\n"
        "    os.waitpid(-1, os.WNOHANG)\n"
        "    children = 'a child left'\n"
        "except ChildProcessError:\n"
        "    children = 'no child left'\n"
        "print(started, children)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(plan)], capture_output=True, text=True, timeout=60, cwd=REPO, check=True
    )
    assert done.stdout.split("\n")[0] == "True no child left"


@pytest.mark.parametrize("command", ["validate", "run", "trial", "rerun"])
def test_the_commands_that_load_tensorflow_read_ahead_first(command, tmp_path, monkeypatch):
    started: list[str] = []
    monkeypatch.setattr(pipeline.cli, "start_read_ahead", lambda: started.append(command))
    argument = "no-such-run" if command == "rerun" else str(tmp_path / "missing.yaml")
    extra = ["--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"] if command == "rerun" else []
    result = CliRunner().invoke(pipeline.cli.app, [command, argument, *extra])
    assert result.exit_code == 2, result.output
    assert started == [command]


def test_the_installed_plan_reads_tensorflows_library_before_its_modules_and_the_trainable(tmp_path, monkeypatch):
    from pipeline.base import private_hooks
    from pipeline.sweep import record_start_up_read_ahead

    monkeypatch.setattr(private_hooks, "held_records", lambda: tmp_path / "hooks-held")
    monkeypatch.setattr(private_hooks, "_HELD", set())
    assert read_ahead.plan_path() == Path(sys.prefix) / "foldsweep-read-ahead.json"
    plan_file = record_start_up_read_ahead(tmp_path / "plan.json")
    assert plan_file == tmp_path / "plan.json"
    identity = private_hooks.installation_identity()  # the install's first sweep trusts the hooks' record
    assert sorted(path.name for path in (tmp_path / "hooks-held").iterdir()) == sorted(
        f"{library}-{identity}" for library in private_hooks.HOOKED_LIBRARIES
    )
    plan = load_plan(plan_file)
    names = [name for name, _, _, _ in plan]
    library = next(i for i, name in enumerate(names) if Path(name).name.startswith("libtensorflow_cc"))
    touched = sum(length for _, length in plan[library][3] or [])
    assert 0 < touched < plan[library][1]  # the pages loading touched, not the whole 1.1 GB
    first_module = min(i for i, name in enumerate(names) if "/tensorflow/" in name and name.endswith(".pyc"))
    assert library < first_module
    assert sys.modules["pipeline.engine.trainable"].__cached__ in names


def test_whoever_reads_the_commands_output_sees_it_end_with_the_command(tmp_path):
    # A plan whose reading outlives the command (a file asked for 100,000 times): the command's
    # output pipe ends with the command, while the reader works on with its streams on /dev/null.
    kept = tmp_path / "kept"
    kept.write_bytes(b"x" * 10_000)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([[str(kept), kept.stat().st_size, kept.stat().st_mtime_ns, None]] * 100_000))
    script = "import sys\nfrom pathlib import Path\nfrom pipeline.base.read_ahead import start_read_ahead\n"
    script += "print(start_read_ahead(Path(sys.argv[1])))\n"
    command = subprocess.Popen([sys.executable, "-c", script, str(plan)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    output, _ = command.communicate(timeout=60)
    readers = [process for process in psutil.process_iter(["cmdline"]) if str(plan) in (process.info["cmdline"] or [])]
    try:
        assert output == "True\n"
        assert len(readers) == 1  # still reading, its parent gone
        streams = {os.readlink(f"/proc/{readers[0].pid}/fd/{stream}") for stream in (0, 1, 2)}
        assert streams == {os.devnull}
    finally:
        for reader in readers:
            reader.kill()
