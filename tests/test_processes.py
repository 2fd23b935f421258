"""Stopping a process tree: every process below the leader ends, one in a session of its own
too, by SIGTERM when it obeys and SIGKILL after the grace period when it does not."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from pipeline.base.processes import descendants, running, stop_process_tree, wait_until_ended

# A shell leading a session of its own, with three sleeping children: one in its group, one in a
# session of its own (out of reach of the group's SIGTERM), one in its group that ignores SIGTERM
# when asked to. Each prints its pid once it is ready (in its session, ignoring SIGTERM).
TREE = """
sleep 300 & echo "grouped $!"
setsid sh -c 'echo "own_session $$"; exec sleep 300' &
( [ "$1" = stubborn ] && trap '' TERM; echo "maybe_stubborn $BASHPID"; exec sleep 300 ) &
wait
"""


def start_tree(kind: str) -> tuple[subprocess.Popen, dict[str, int]]:
    """The leader and its children's pids by name (they print them in any order)."""
    leader = subprocess.Popen(
        ["bash", "-c", TREE, "tree", kind], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    children = dict(leader.stdout.readline().split() for _ in range(3))
    return leader, {name: int(pid) for name, pid in children.items()}


@pytest.fixture
def tree(request):
    """(the leader, its children's pids by name); whatever a failed test leaves is killed."""
    leader, children = start_tree(request.param)
    yield leader, children
    for pid in [leader.pid, *children.values()]:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    leader.wait(timeout=30)


def still_running(pids: list[int]) -> list[int]:
    """Those of ``pids`` that have not ended once SIGKILL has had up to 30 s to land (an orphan
    ended counts: the machine's init may take seconds to remove it)."""
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return [process.pid for process in wait_until_ended(processes, timeout_s=30)]


@pytest.mark.parametrize("tree", ["obedient"], indirect=True)
def test_the_whole_tree_ends_by_sigterm_one_in_a_session_of_its_own_too(tree):
    leader, children = tree
    found = descendants(leader.pid)
    assert sorted(process.pid for process in found) == sorted(children.values())
    assert {name: os.getsid(pid) == leader.pid for name, pid in children.items()} == {
        "grouped": True,
        "own_session": False,
        "maybe_stubborn": True,
    }

    killed = stop_process_tree(leader.pid)

    assert killed == []
    assert still_running([leader.pid, *children.values()]) == []
    assert not any(running(process) for process in found)


@pytest.mark.parametrize("tree", ["stubborn"], indirect=True)
def test_what_ignores_sigterm_is_killed_after_the_grace_period(tree):
    leader, children = tree
    stubborn = children["maybe_stubborn"]

    # The others end by SIGTERM well within the grace period, even on a loaded machine.
    killed = stop_process_tree(leader.pid, grace_s=2)

    assert [process.pid for process in killed] == [stubborn]
    assert still_running([leader.pid, *children.values()]) == []


def test_a_tree_already_gone_is_left_alone():
    leader = subprocess.Popen(["true"])
    process = psutil.Process(leader.pid)
    leader.wait(timeout=30)
    assert descendants(leader.pid) == []
    assert not running(process)


# A process that leaves through ``leave``: a worker thread still running, an atexit handler, and
# output not yet flushed, each of which a bare os._exit would lose; and an executor never shut
# down, whose idle worker thread Python's exit stops (threading's own exit hooks) before it
# waits for the threads.
LEAVING = """
import atexit, sys, threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from pipeline.base.processes import leave

idle = ThreadPoolExecutor(max_workers=1)
idle.submit(lambda: None).result()

out = Path(sys.argv[1])
gate = threading.Lock()
gate.acquire()

def finish_work():
    with gate:
        (out / "thread").write_text("done")

threading.Thread(target=finish_work).start()
atexit.register(lambda: (out / "atexit").write_text("ran after the thread: " + str((out / "thread").exists())))
sys.stdout.write("unflushed")
gate.release()
leave(eval(sys.argv[2]))
"""


@pytest.mark.parametrize(("code", "exit_code"), [("None", 0), ("3", 3), ("'stopped: why'", 1)])
def test_leaving_keeps_what_a_normal_exit_does(tmp_path, code, exit_code):
    ran = subprocess.run(
        [sys.executable, "-c", LEAVING, str(tmp_path), code], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == exit_code
    assert ran.stdout == "unflushed"
    assert ran.stderr == ("stopped: why\n" if exit_code == 1 else "")
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "ran after the thread: True"


def test_a_profiled_process_leaves_as_python_does_and_its_profile_is_written(tmp_path):
    """Under ``python -m cProfile`` leaving is ``sys.exit``: the profile is written after the program
    returns (and cProfile's own exit code is the same for both)."""
    exit_codes = []
    for way in ("from pipeline.base.processes import leave; leave(3)", "import sys; sys.exit(3)"):
        script, profile = tmp_path / "leaving.py", tmp_path / "leaving.prof"
        script.write_text(way)
        profile.unlink(missing_ok=True)
        ran = subprocess.run(
            [sys.executable, "-m", "cProfile", "-o", str(profile), str(script)], capture_output=True, timeout=120
        )
        exit_codes.append(ran.returncode)
        assert profile.stat().st_size > 0, way
    assert exit_codes[0] == exit_codes[1]
