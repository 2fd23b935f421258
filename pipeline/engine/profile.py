"""One epoch of a trial under TensorFlow's profiler, and what its trace says.

``foldsweep rerun --profile`` and ``foldsweep trial --profile`` run one steady-state epoch between
``tf.profiler.experimental.start`` and ``stop``, which write an XSpace where the viewers read it
(``<logdir>/plugins/profile/<run>/<host>.xplane.pb``: XProf, TensorBoard's profile plugin). This
module reads that file with TensorFlow's own protocol buffer (``xplane_pb2``), a thread (XLine) at
a time: an epoch at batch 8 is millions of events, and TensorFlow's conversion to the viewer's
JSON timeline took 11 GB for one. An event is an operation when TensorFlow says so: an XLA op
carries the ``hlo_op`` stat, a TensorFlow op is named ``node:type``. Each operation's self time
(its time less that of the events inside it on its thread) is summed over its calls and the
folds, and the share of the training during which no operation ran at all is the host between
launches (dispatch, loop control, Python). The trainer marks its training and validation
(``TRAIN_REGION``, ``VALIDATION_REGION``), so the trace says how long each took.

An XLA program on the CPU is one TensorFlow op; its HLO ops reach the trace only when XLA is told
to mark them, before TensorFlow starts (``enable_xla_op_tracing``; a compile-cache store of its
own, since the flags differ).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import time
from array import array
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.base.tensorflow_private import parsed_xspace

XLA_TRACEME_FLAG = "--xla_cpu_enable_xprof_traceme=true"
# Where ``--profile`` writes its traces (TensorFlow's profiler adds plugins/profile/<time>/ below).
PROFILES = Path("profiles")
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

    def lines(self) -> list[str]:
        """What the profile says, as ``--profile`` prints it: the epoch's parts, the top operations,
        the host's share, and the command that opens the trace."""

        def part(seconds: float) -> str:
            return f"{seconds:.3f} s ({seconds / self.wall_s:.0%})" if self.wall_s > 0 else f"{seconds:.3f} s"

        parts = ", ".join(f"{name} {part(seconds)}" for name, seconds in self.parts.items())
        lines = [
            f"profile of epoch {self.epoch}: its wall clock {self.wall_s:.3f} s = {parts}; the gap holds the "
            f"profiler's start, {self.profiler_start_s:.3f} s",
            "top operations by self time, all folds (share of all operations' self time):",
        ]
        lines += [f"  {op.self_s:9.4f} s  {op.share:6.1%}  {op.name}" for op in self.top_ops]
        lines.append(
            f"no operation runs for {self.host_between_share:.0%} of the training launches' time: the host "
            "between launches (dispatch, loop control, Python)"
        )
        viewer = f"xprof --logdir={shlex.quote(str(self.logdir))} --port=6006"
        if importlib.util.find_spec("xprof") is None:  # the optional extra (pyproject.toml: profile)
            viewer = f"uv run --extra profile {viewer}"
        lines.append(f"trace: {self.trace_file}; open it with: {viewer}")
        return lines


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
        written = sorted(
            set(self.logdir.glob("plugins/profile/*/*.xplane.pb")) - before, key=lambda path: path.stat().st_mtime
        )
        if not written:
            raise RuntimeError(f"TensorFlow's profiler wrote no trace under {self.logdir}/plugins/profile")
        return written[-1]


# Events TensorFlow marks as ops that hold other operations: a function's or XLA program's launch
# (counted as the operations inside it) and the graph's loops and conditions around them.
LAUNCHES = ("StatefulPartitionedCall", "PartitionedCall", "XlaLaunch", "XlaLaunchV2", "_XlaRun", "_XlaCompile")


def op_name(name: str, display_name: str, *, hlo: bool) -> str | None:
    """The operation an event is a call of, its instance number left out so that every fold's
    (and every step's) calls add up (``convolution.1`` -> ``convolution``): an XLA op (``hlo``,
    the event has TensorFlow's ``hlo_op`` stat) by its name, a TensorFlow op by its type (the
    event's display name; its name is ``node:type``); None for an event that is neither, or a
    launch of operations counted on their own."""
    if hlo:
        return re.sub(r"\.\d+$", "", name)
    if not display_name or ":" not in name or display_name.startswith("__") or display_name in LAUNCHES:
        return None
    return display_name


class TraceTimes:
    """What the trace's threads add up to: each operation's self time (its time less that of the
    events directly inside it on its thread), summed over calls and folds; when operations ran;
    and the regions foldsweep marked. Fed a thread at a time, so that a trace of millions of
    events (an epoch of thousands of steps) is read without holding them."""

    def __init__(self) -> None:
        self.self_us: dict[str, float] = defaultdict(float)
        self.regions: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self._starts = array("d")
        self._ends = array("d")

    def add_thread(self, events: Iterable[tuple[str, str | None, float, float]]) -> None:
        """One thread's events as (name, operation or None, start, end) in microseconds, in the
        order they started."""
        stack: list[list[Any]] = []  # [operation, end, duration, children's time]
        for name, op, start, end in events:
            while stack and stack[-1][1] <= start:
                self._close(stack.pop())
            if stack:
                stack[-1][3] += min(end, stack[-1][1]) - start
            stack.append([op, end, end - start, 0.0])
            if name in (TRAIN_REGION, VALIDATION_REGION):
                self.regions[name].append((start, end))
            if op is not None:
                self._starts.append(start)
                self._ends.append(end)
        while stack:
            self._close(stack.pop())

    def _close(self, entry: list[Any]) -> None:
        if entry[0] is not None:
            self.self_us[entry[0]] += max(entry[2] - entry[3], 0.0)

    def top_operations(self, top: int = TOP_OPS) -> list[OpTime]:
        """The operations with the most self time, with their share of all operations' self time."""
        whole = sum(self.self_us.values())
        ranked = sorted(self.self_us.items(), key=lambda item: -item[1])[:top]
        return [OpTime(name, seconds / 1e6, seconds / whole if whole else 0.0) for name, seconds in ranked]

    def idle_share(self, windows: Sequence[tuple[float, float]]) -> float:
        """The share of ``windows`` during which no operation ran on any thread."""
        import numpy as np

        starts, ends = np.frombuffer(self._starts), np.frombuffer(self._ends)
        total = busy = 0.0
        for low, high in windows:
            total += high - low
            begin, end = np.maximum(starts, low), np.minimum(ends, high)
            inside = end > begin
            begin, end = begin[inside], end[inside]
            order = np.argsort(begin, kind="stable")
            begin, end = begin[order], end[order]
            # each call adds what it covers beyond the furthest end of the calls before it
            reach = np.concatenate([[low], np.maximum.accumulate(end)[:-1]]) if len(end) else end
            busy += float(np.sum(np.clip(end - np.maximum(begin, reach), 0.0, None)))
        return 1.0 - busy / total if total else float("nan")


def read_xspace(xspace: Path) -> TraceTimes:
    """The times of the XSpace TensorFlow's profiler wrote (its own protocol buffer, the one the
    viewers read), its threads one at a time."""
    space = parsed_xspace(xspace.read_bytes())
    times = TraceTimes()
    for plane in space.planes:
        hlo_stats = {key for key, stat in plane.stat_metadata.items() if stat.name == "hlo_op"}
        metadata = plane.event_metadata
        known: dict[int, str | None] = {}  # an event's operation, the same for every event of its metadata

        def operation(event: Any) -> str | None:
            if event.metadata_id not in known:
                about = metadata[event.metadata_id]
                hlo = any(stat.metadata_id in hlo_stats for stat in event.stats)
                known[event.metadata_id] = op_name(about.name, about.display_name, hlo=hlo)
            return known[event.metadata_id]

        for line in plane.lines:
            origin = line.timestamp_ns * 1e3  # microseconds; events are placed in picoseconds
            events = sorted(line.events, key=lambda event: (event.offset_ps, -event.duration_ps))
            times.add_thread(
                (
                    metadata[event.metadata_id].name,
                    operation(event),
                    origin + event.offset_ps / 1e6,
                    origin + (event.offset_ps + event.duration_ps) / 1e6,
                )
                for event in events
            )
    return times


def summarize(
    xspace: Path, *, epoch: int, logdir: Path, epoch_wall_s: float, gap_s: float, profiler_start_s: float
) -> EpochProfile:
    """What the trace of one epoch says, with the trial clock's measure of that epoch's wall time
    and of the gap before it."""
    times = read_xspace(xspace)
    training, validation = times.regions[TRAIN_REGION], times.regions[VALIDATION_REGION]
    return EpochProfile(
        epoch=epoch,
        wall_s=epoch_wall_s,
        train_s=sum(end - start for start, end in training) / 1e6,
        validation_s=sum(end - start for start, end in validation) / 1e6,
        gap_s=gap_s,
        profiler_start_s=profiler_start_s,
        top_ops=tuple(times.top_operations()),
        host_between_share=times.idle_share(training),
        logdir=logdir,
        trace_file=xspace,
    )
