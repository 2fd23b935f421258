"""The files a command's processes read as they start, asked of the kernel ahead of them.

A sweep's driver and each of its Ray workers load TensorFlow, Keras, Ray and MLflow: thousands
of modules' bytecode and hundreds of megabytes of shared libraries' pages. Where those are not in
the page cache (after a reboot, or where the kernel pages out idle page cache, as DAMON's
``pageout`` scheme does after a minute), each process faults them in a few pages at a time while
the cores are busy loading, and the sweep starts that much later (``docs/time.md``). A plan of
those files, in the order the processes need them, with each library's pages that a process
loading them touched, is recorded once per environment, in it (``record_read_ahead``, run by
``make install`` and ``make sweep``); a command that is about to load them asks the kernel to
read the plan ahead (``start_read_ahead``), from a process of its own, while it checks its
inputs and starts Ray: the disk works while the cores load. The kernel reads what it is asked in
the background and keeps it as it keeps any page cache; pages cached already are not read again,
and a file changed since the plan was recorded is skipped.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import struct
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pipeline.base.forking import may_fork_beside

# A plan entry: a file, its size and modification time as recorded, and the byte ranges of it to
# read ([offset, length] pairs), or None for the whole file.
PlanEntry = tuple[str, int, int, list[tuple[int, int]] | None]
_PAGE_PRESENT = 1 << 63  # /proc/PID/pagemap: the page is in this process's memory
PLAN_NAME = "foldsweep-read-ahead.json"  # in sys.prefix; the Makefile's READ_AHEAD names it too


def plan_path() -> Path:
    """This environment's plan, kept in the environment (``sys.prefix``, a virtual environment)
    whose installed files it names, and removed with it."""
    return Path(sys.prefix) / PLAN_NAME


def record_read_ahead(modules: Sequence[str], path: Path | None = None) -> Path | None:
    """Import ``modules`` in order, then write the plan of what this process has loaded (to
    ``path``, by default ``plan_path()``): each module's bytecode or extension, in the order they
    were imported, and each shared library this process maps with the pages of it in memory,
    placed before the first module of its package. None where this system has no
    ``/proc/self/pagemap`` or the plan cannot be written."""
    for module in modules:
        importlib.import_module(module)
    try:
        touched = _touched_ranges()
    except OSError:
        return None
    plan = [_entry(name, ranges) for name, ranges in _need_order(_module_files(), touched)]
    target = path or plan_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = target.with_name(f".{target.name}.{os.getpid()}")
        scratch.write_text(json.dumps([entry for entry in plan if entry is not None]))
        os.replace(scratch, target)
    except OSError:
        return None
    return target


def start_read_ahead(path: Path | None = None) -> bool:
    """Ask the kernel to read this environment's plan (``path``, by default ``plan_path()``)
    ahead, from a process that leaves at once and whose child works on alone; returns whether
    one was started. Nothing is started without a plan, or where no helper may be forked
    (``may_fork_beside``): a process that has TensorFlow or Ray loaded has their libraries in
    memory already."""
    plan = path or plan_path()
    if not may_fork_beside() or not hasattr(os, "posix_fadvise") or not plan.is_file():
        return False
    child = os.fork()
    if child == 0:  # pragma: no cover - the forked processes leave by os._exit, never returning here
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the command's to report
            if os.fork() == 0:  # the grandchild reads ahead; the init process reaps it
                try:
                    _let_go_of_the_commands_files()
                    read_ahead(load_plan(plan))
                finally:
                    os._exit(0)
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    return True


def _let_go_of_the_commands_files() -> None:
    """Standard streams on /dev/null and every other inherited descriptor closed: whoever reads
    the command's output (a pipe, ``subprocess.run``) sees it end when the command ends, not
    when the reading ahead does."""
    null = os.open(os.devnull, os.O_RDWR)
    for stream in (0, 1, 2):
        os.dup2(null, stream)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))


def load_plan(path: Path) -> list[PlanEntry]:
    """A recorded plan's entries; [] for one that cannot be read."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [
        (name, size, mtime, None if ranges is None else [(int(offset), int(length)) for offset, length in ranges])
        for name, size, mtime, ranges in entries
    ]


def read_ahead(plan: Iterable[PlanEntry]) -> int:
    """Ask the kernel to read each file of ``plan`` (its ranges, or all of it) into the page
    cache, in order, skipping the files that changed since the plan was recorded or are gone;
    returns how many files were asked for. The kernel reads in the background
    (``POSIX_FADV_WILLNEED``)."""
    asked = 0
    for name, size, mtime, ranges in plan:
        try:
            descriptor = os.open(name, os.O_RDONLY)
        except OSError:
            continue
        try:
            status = os.fstat(descriptor)
            if status.st_size != size or status.st_mtime_ns != mtime:
                continue
            for offset, length in ranges if ranges is not None else [(0, 0)]:
                os.posix_fadvise(descriptor, offset, length, os.POSIX_FADV_WILLNEED)
            asked += 1
        except OSError:
            continue
        finally:
            os.close(descriptor)
    return asked


def _module_files() -> list[tuple[str, str]]:
    """Each loaded module's top-level package and file (its bytecode, or its extension), in
    the order the modules were imported."""
    files = []
    for name, module in list(sys.modules.items()):
        cached, source = getattr(module, "__cached__", None), getattr(module, "__file__", None)
        chosen = cached if isinstance(cached, str) and os.path.isfile(cached) else source
        if isinstance(chosen, str) and os.path.isfile(chosen):
            files.append((name.partition(".")[0], chosen))
    return files


def _touched_ranges() -> dict[str, list[tuple[int, int]]]:
    """The byte ranges of each file this process maps (shared libraries, extensions) whose pages
    are in its memory, from ``/proc/self/maps`` and ``/proc/self/pagemap``, merged and sorted."""
    page = os.sysconf("SC_PAGE_SIZE")
    pages: dict[str, set[int]] = {}
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[5].startswith("/"):
                continue
            name = fields[5].rstrip("\n")
            if name.endswith(" (deleted)") or not os.path.isfile(name):
                continue
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            first_page = int(fields[2], 16) // page
            count = (end - start) // page
            pagemap.seek(start // page * 8)
            words = struct.unpack(f"<{count}Q", pagemap.read(count * 8))
            pages.setdefault(name, set()).update(first_page + i for i, word in enumerate(words) if word & _PAGE_PRESENT)
    return {name: _ranges(sorted(numbers), page) for name, numbers in pages.items() if numbers}


def _ranges(numbers: Sequence[int], page: int) -> list[tuple[int, int]]:
    """Sorted page numbers as [offset, length] byte ranges of consecutive pages."""
    ranges: list[tuple[int, int]] = []
    for number in numbers:
        if ranges and ranges[-1][0] + ranges[-1][1] == number * page:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + page)
        else:
            ranges.append((number * page, page))
    return ranges


def _need_order(
    modules: Sequence[tuple[str, str]], touched: dict[str, list[tuple[int, int]]]
) -> list[tuple[str, list[tuple[int, int]] | None]]:
    """The files to read, in the order a process needs them: the modules' files in import order,
    with every mapped file of a package (with its touched ranges; the libraries first, then its
    extensions) just before the package's first module, and last the mapped files of no loaded
    package."""
    libraries: dict[str, list[str]] = {}
    for name in touched:
        libraries.setdefault(_package_of(name), []).append(name)
    order: list[tuple[str, list[tuple[int, int]] | None]] = []
    placed: set[str] = set()

    def place(name: str) -> None:
        if name not in placed:
            placed.add(name)
            order.append((name, touched.get(name)))

    for package, name in modules:
        for library in sorted(libraries.pop(package, []), key=lambda library: (not _is_library(library), library)):
            place(library)
        place(name)
    for rest in libraries.values():
        for library in rest:
            place(library)
    return order


def _package_of(name: str) -> str:
    """The top-level package whose directory (or ``<package>.libs``) holds ``name`` in a
    ``site-packages`` directory; "" for a file outside one."""
    _, marker, inside = name.partition("site-packages/")
    return inside.split("/", 1)[0].split(".", 1)[0] if marker else ""


def _is_library(name: str) -> bool:
    """A shared library that is not a Python module (``libtensorflow_cc.so.2``)."""
    return Path(name).name.startswith("lib")


def _entry(name: str, ranges: list[tuple[int, int]] | None) -> list[Any] | None:
    try:
        status = os.stat(name)
    except OSError:
        return None
    return [name, status.st_size, status.st_mtime_ns, ranges]
