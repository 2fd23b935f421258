"""One epoch of a trial under TensorFlow's profiler, and what its trace says.

``foldsweep rerun --profile`` and ``foldsweep trial --profile`` run one steady-state epoch between
``tf.profiler.experimental.start`` and ``stop``, which write an XSpace where the viewers read it
(``<logdir>/plugins/profile/<run>/<host>.xplane.pb``: XProf, TensorBoard's profile plugin). The
same library turns it into the viewer's timeline (``xspace_to_tools_data(..., "trace_viewer@")``):
trace events, each on a thread, an operation marked by its arguments (``is_eager`` on a
TensorFlow op, ``hlo_op`` on an XLA one). From those this module sums each operation's self time
(its time less that of the events inside it on its thread) over the folds, and how much of the
training no operation ran at all: the host between launches (dispatch, loop control, Python).
The trainer marks its training and validation (``TRAIN_REGION``, ``VALIDATION_REGION``), so the
trace says how long each took.

An XLA program on the CPU is one TensorFlow op; its HLO ops reach the trace only when XLA is told
to mark them, before TensorFlow starts (``enable_xla_op_tracing``; a compile-cache store of its
own, since the flags differ).
"""

from __future__ import annotations

import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

XLA_TRACEME_FLAG = "--xla_cpu_enable_xprof_traceme=true"
TRAIN_REGION = "foldsweep.train"
VALIDATION_REGION = "foldsweep.validate"
TOP_OPS = 10


def enable_xla_op_tracing() -> None:
    """XLA's CPU programs mark each HLO op for the profiler: before TensorFlow starts."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if XLA_TRACEME_FLAG not in flags:
        os.environ["XLA_FLAGS"] = " ".join([*flags, XLA_TRACEME_FLAG])


@dataclass(frozen=True)
class OpTime:
    """An operation's self time summed over every call in the profile (all folds), and its share
    of all operations' self time."""

    name: str
    self_s: float
    share: float


@dataclass(frozen=True)
class EpochProfile:
    """A profiled epoch: its wall clock (since the previous epoch's validation ended) split into
    training launches and validation (as the trace marks them) and the gap before them (as the
    trial's clock measured it, the profiler's start included), the top operations by self time,
    and the share of the training during which no operation ran."""

    epoch: int
    wall_s: float
    train_s: float
    validation_s: float
    gap_s: float
    profiler_start_s: float
    top_ops: tuple[OpTime, ...]
    host_between_share: float
    logdir: Path
    trace_file: Path

    @property
    def parts(self) -> dict[str, float]:
        return {"training launches": self.train_s, "validation": self.validation_s, "gap before the epoch": self.gap_s}


class EpochProfiler:
    """Starts TensorFlow's profiler before one epoch and stops it after, timing its own start."""

    def __init__(self, epoch: int, logdir: Path):
        self.epoch = epoch
        self.logdir = Path(logdir)
        self.start_s = 0.0

    def start(self) -> None:
        import tensorflow as tf

        self.logdir.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        tf.profiler.experimental.start(str(self.logdir))
        self.start_s = time.perf_counter() - began

    def stop(self) -> Path:
        """Stop and write the trace; returns the XSpace file written."""
        import tensorflow as tf

        before = set(self.logdir.glob("plugins/profile/*/*.xplane.pb"))
        tf.profiler.experimental.stop()
        written = sorted(set(self.logdir.glob("plugins/profile/*/*.xplane.pb")) - before,
                         key=lambda path: path.stat().st_mtime)
        if not written:
            raise RuntimeError(f"TensorFlow's profiler wrote no trace under {self.logdir}/plugins/profile")
        return written[-1]


def trace_events(xspace: Path) -> list[dict[str, Any]]:
    """The XSpace's events as the trace viewer shows them (TensorFlow's own conversion)."""
    import json

    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin

    data, converted = _pywrap_profiler_plugin.xspace_to_tools_data([str(xspace)], "trace_viewer@", {})
    if not converted:
        raise RuntimeError(f"TensorFlow cannot read the trace {xspace}: {data!r}")
    return json.loads(data)["traceEvents"]


def op_name(event: Mapping[str, Any]) -> str | None:
    """The operation an event is a call of, its instance number left out so that every fold's
    (and every step's) calls add up (``convolution.1`` -> ``convolution``); None for an event
    that is no operation, or that holds a compiled program's operations (counted as those)."""
    args = event.get("args") or {}
    if "hlo_op" in args:
        return re.sub(r"\.\d+$", "", str(args["hlo_op"]))
    if "is_eager" in args:
        name = str(event.get("name", ""))
        if name.startswith("__") or "Xla" in name:  # a function or XLA program's launch
            return None
        return name
    return None


def self_times(events: Iterable[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], float]]:
    """Each complete event with its self time in microseconds: its duration less that of the
    events directly inside it on its thread."""
    by_thread: dict[Any, list[Mapping[str, Any]]] = defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and "dur" in event:
            by_thread[(event.get("pid"), event.get("tid"))].append(event)
    timed = []
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda event: (float(event["ts"]), -float(event["dur"])))
        stack: list[list[Any]] = []  # [event, end, children's time]
        for event in thread_events:
            start, end = float(event["ts"]), float(event["ts"]) + float(event["dur"])
            while stack and stack[-1][1] <= start:
                done = stack.pop()
                timed.append((done[0], float(done[0]["dur"]) - done[2]))
            if stack:
                stack[-1][2] += min(end, stack[-1][1]) - start
            stack.append([event, end, 0.0])
        timed.extend((done[0], float(done[0]["dur"]) - done[2]) for done in stack)
    return timed


def top_operations(events: Sequence[Mapping[str, Any]], *, top: int = TOP_OPS) -> list[OpTime]:
    """The operations with the most self time, summed over their calls, with their share of all
    operations' self time."""
    totals: dict[str, float] = defaultdict(float)
    for event, self_us in self_times(events):
        name = op_name(event)
        if name is not None:
            totals[name] += max(self_us, 0.0)
    whole = sum(totals.values())
    ranked = sorted(totals.items(), key=lambda item: -item[1])[:top]
    return [OpTime(name, seconds / 1e6, seconds / whole if whole else 0.0) for name, seconds in ranked]


def regions(events: Sequence[Mapping[str, Any]], name: str) -> list[tuple[float, float]]:
    """The (start, end) in microseconds of each event named ``name`` (a region foldsweep marks)."""
    return [(float(event["ts"]), float(event["ts"]) + float(event["dur"])) for event in events
            if event.get("ph") == "X" and event.get("name") == name]


def idle_share(events: Sequence[Mapping[str, Any]], windows: Sequence[tuple[float, float]]) -> float:
    """The share of ``windows`` during which no operation ran on any thread."""
    calls = sorted((float(event["ts"]), float(event["ts"]) + float(event["dur"])) for event in events
                   if event.get("ph") == "X" and op_name(event) is not None)
    total = busy = 0.0
    for low, high in windows:
        total += high - low
        reach = low
        for start, end in calls:
            start, end = max(start, reach), min(end, high)
            if end > start:
                busy += end - start
                reach = end
    return 1.0 - busy / total if total else float("nan")


def summarize(xspace: Path, *, epoch: int, logdir: Path, epoch_wall_s: float, gap_s: float,
              profiler_start_s: float) -> EpochProfile:
    """What the trace of one epoch says, with the trial clock's measure of that epoch's wall time
    and of the gap before it."""
    events = trace_events(xspace)
    training = regions(events, TRAIN_REGION)
    validation = regions(events, VALIDATION_REGION)
    return EpochProfile(epoch=epoch, wall_s=epoch_wall_s, train_s=sum(end - start for start, end in training) / 1e6,
                        validation_s=sum(end - start for start, end in validation) / 1e6, gap_s=gap_s,
                        profiler_start_s=profiler_start_s, top_ops=tuple(top_operations(events)),
                        host_between_share=idle_share(events, training), logdir=logdir, trace_file=xspace)
