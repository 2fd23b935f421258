"""Ending processes: a tree of them (a server and the workers it started), on psutil, and this one
(``leave``, how every command ends).

A process that has ended but not yet been waited for by its parent (a zombie) counts as ended:
it holds no memory or port, and only its parent can remove it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil

# How often the wait for a tree to end looks again for processes that have become zombies, which
# psutil's wait takes for running when they are not this process's children.
ZOMBIE_CHECK_S = 0.1


def descendants(pid: int) -> list[psutil.Process]:
    """Every live process below ``pid`` (children, their children...); none if ``pid`` is gone."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def running(process: psutil.Process) -> bool:
    """``process`` has not ended (the same process: its pid taken by a new one does not count)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_process_tree(pid: int, *, grace_s: float = 10.0) -> list[psutil.Process]:
    """SIGTERM the process group ``pid`` leads and every process descended from ``pid`` (one that
    started a session of its own too), then SIGKILL those still running after ``grace_s``.

    Returns the processes that had to be killed (SIGKILL is sent, not waited for). A child of
    this process that ends in time is reaped here: its ``Popen.wait()`` then returns 0.
    """
    try:
        family = [psutil.Process(pid), *descendants(pid)]
    except psutil.NoSuchProcess:  # the leader has ended: its group may not have
        family = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.terminate()
    survivors = wait_until_ended(family, timeout_s=grace_s)
    for member in survivors:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    return survivors


def wait_until_ended(processes: list[psutil.Process], *, timeout_s: float) -> list[psutil.Process]:
    """Those of ``processes`` still running after ``timeout_s`` at most (sooner once none is)."""
    deadline = time.monotonic() + timeout_s
    waiting = [process for process in processes if running(process)]
    while waiting and (left := deadline - time.monotonic()) > 0:
        _, still = psutil.wait_procs(waiting, timeout=min(left, ZOMBIE_CHECK_S))
        waiting = [process for process in still if running(process)]
    return waiting


def leave(code: str | int | None) -> None:
    """End this process with exit ``code`` as ``sys.exit`` would, without tearing the interpreter down.

    Everything a normal exit does for the process's results still happens, in the same order:
    threading's own exit hooks stop what waits for work (the idle threads of executors never shut
    down) and other non-daemon threads are waited for, then the ``atexit`` handlers run (the
    compile cache files its new programs, logging and open temporary directories are closed),
    then the output is flushed. What is skipped is freeing every module and object one by one,
    which changes nothing on disk and took 1.2 s of a process that had only imported TensorFlow,
    Ray and MLflow, and 2-3 s at the end of a sweep. A process under a profiler or a tracer
    (``python -m cProfile``, a debugger, coverage) exits as Python does: such a tool writes what it
    gathered once the program has returned.
    """
    import atexit
    import sys
    import threading

    # CPython's own exit calls these two, in this order
    stop_threads = getattr(threading, "_shutdown", None)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    profiled = sys.getprofile() is not None or sys.gettrace() is not None
    if profiled or stop_threads is None or run_exit_handlers is None:
        sys.exit(code)
    if code is not None and not isinstance(code, int):  # sys.exit("message"): on stderr, exit 1
        print(code, file=sys.stderr)
        code = 1
    stop_threads()
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)
