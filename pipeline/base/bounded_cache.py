"""A directory of cached files kept within a size: past it, the least recently used go first.

foldsweep's caches (compiled programs, split folds) gain a file for each new program or data a
researcher runs, and would otherwise grow for as long as the machine is used. A file's last use
is the later of its access and modification times; a cache whose readers cannot rely on the
mount updating access times (``relatime`` updates them at most daily, ``noatime`` never) marks
each read itself (``mark_used``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def prune(directory: Path, pattern: str, limit_bytes: int, *, remove: Callable[[Path], None] = _unlink) -> list[str]:
    """Remove (``remove``) the least recently used of ``directory``'s files matching ``pattern``
    until those left fit in ``limit_bytes``; returns the names removed, least recent first."""
    entries = []
    for entry in directory.glob(pattern):
        with contextlib.suppress(OSError):
            status = entry.stat()
            entries.append((max(status.st_atime, status.st_mtime), status.st_size, entry))
    total = sum(size for _, size, _ in entries)
    removed = []
    for _, size, entry in sorted(entries, key=lambda item: item[0]):
        if total <= limit_bytes:
            break
        remove(entry)
        total -= size
        removed.append(entry.name)
    return removed


def mark_used(path: Path) -> None:
    """Count ``path`` as used now, whatever the mount does with access times (nothing where the
    file cannot be touched: it is then pruned as if unread)."""
    with contextlib.suppress(OSError):
        os.utime(path)
