"""Loading the large libraries without Python's cyclic garbage collector walking them.

Importing Keras (and TensorFlow with it) makes some 665,000 tracked objects, nearly all of
which live as long as the process: modules, functions, classes, their dicts. Python's collector
walks every tracked object at each full collection; while they load, it runs a full collection
every few hundred thousand allocations, and after they have loaded each full collection of a
trial's tracing walks them all again. Measured with ``gc.callbacks`` in a 4-trial sweep: its
driver spent 1.48 s in collections and each of its two workers 1.25 s, nearly all in full ones
(0.13 s each); with these pauses, 0.58 s and 0.45 s.

So the collector pauses while they load, and then what is there is frozen (``gc.freeze``):
later collections skip it, and objects made afterwards are collected as before. Freezing keeps
whatever is garbage at that moment for good, so a pause around checks (which may build a model
only to check it) first runs one full collection; a pause that only loads modules does not, as
what loading leaves unreachable is a megabyte. An object alive when it is frozen and dropped
later in a reference cycle is never collected: where foldsweep pauses, what is alive then is
the libraries, the spec and its data, which a process keeps to its end.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused(*, collect: bool = True) -> Iterator[None]:
    """The block runs without cyclic garbage collection; then what it left unreachable is
    collected (with ``collect``), and everything still tracked is frozen.

    A block that only loads modules may skip the collection: loading TensorFlow and Keras leaves
    ~5,400 of its ~800,000 objects unreachable (import-time cycles, about a megabyte, kept
    frozen), and finding them is a full collection of 0.3 s, on the way to every sweep's first
    step in the driver and in each worker. A block that may build something only to check it
    collects.

    Nothing changes where the collector was already off (the caller's choice, or a pause around
    this one).
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if collect:
            gc.collect()
        gc.freeze()
        gc.enable()
