"""Whether this process may fork a helper beside itself (the folds' split, the read-ahead).

A fork copies only the forking thread: locks held by TensorFlow's or Ray's threads stay held in
the child forever. So a helper is forked only on Linux (macOS' system libraries refuse a fork
beside threads they started), and only before TensorFlow and Ray are loaded, as a command's
start-up forks them; a process that has them loaded (a notebook, the tests) does the work in
place or not at all.
"""

from __future__ import annotations

import sys

# The libraries whose threads make a fork beside them unsafe.
THREADED_LIBRARIES = ("tensorflow", "ray")


def may_fork_beside() -> bool:
    """This process is on Linux and has loaded none of ``THREADED_LIBRARIES``."""
    return sys.platform.startswith("linux") and not any(name in sys.modules for name in THREADED_LIBRARIES)
