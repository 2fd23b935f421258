"""Loading the large libraries without Python's cyclic garbage collector walking them.

Importing Keras (and TensorFlow with it) makes some 665,000 tracked objects, nearly all of
which live as long as the process: modules, functions, classes, their dicts. Python's collector
walks every tracked object at each full collection; while they load, it runs a full collection
every few hundred thousand allocations, and after they have loaded each full collection of a
trial's tracing walks them all again. Measured with ``gc.callbacks`` in a 4-trial sweep: its
driver spent 1.48 s in collections and each of its two workers 1.25 s, nearly all in full ones
(0.13 s each); with these pauses, 0.58 s and 0.45 s.

So the collector pauses while they load; then one full collection frees what loading left
unreachable, and what is left is frozen (``gc.freeze``): later collections skip it, and objects
made afterwards are collected as before. Freezing without that collection would keep whatever
was garbage at that moment for good (a model built only to be checked). An object alive when
it is frozen and dropped later in a reference cycle is never collected: where foldsweep pauses,
what is alive then is the libraries, the spec and its data, which a process keeps to its end.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The block runs without cyclic garbage collection; then what it left unreachable is
    collected, and everything still tracked is frozen.

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
        gc.collect()
        gc.freeze()
        gc.enable()
