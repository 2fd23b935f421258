"""Loading the large libraries without Python's cyclic garbage collector walking them.

Importing Keras (and TensorFlow with it) makes some 665,000 tracked objects, nearly all of
which live as long as the process: modules, functions, classes, their dicts. Python's collector
walks every tracked object at each full collection; while they load, it runs a full collection
every few hundred thousand allocations, and after they have loaded each full collection of a
trial's tracing walks them all again. Measured with ``gc.callbacks``, in a small sweep's driver
and each of its two workers: 1.3-1.5 s per process in collections, nearly all in full ones
(0.13 s each).

So the collector pauses while they load, and what they loaded is then frozen (``gc.freeze``):
later collections skip it, and objects made afterwards are collected as before. What loading
leaves in reference cycles stays (4,051 objects after Keras, for 0.29 s of a collection that
would free them): a process keeps its libraries to its end anyway.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The block runs without cyclic garbage collection; everything it leaves tracked is frozen.

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
        gc.freeze()
        gc.enable()
