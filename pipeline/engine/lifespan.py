"""How long a worker process lives: what each trial leaves behind in it, released before the next
one, and when it retires, by its trials, its memory mappings or its memory.

What a trial leaves behind, measured (a worker's trial loop in one process, MNIST-1D, XLA with
the compile cache, ``benchmarks.soak``): about 10 MB per trial, two thirds of it the trial's
traced graphs, which TensorFlow's gradient registry keeps for the life of the process (Keras'
optimizer sums its gradients through a ``tf.custom_gradient`` that registers a gradient
function, holding the step's graph, under a new name at every trace); ``release_trial`` drops
them. The rest (about 3.5 MB per trial) is XLA's in-process state for each trial's programs,
which no API releases: memory retirement bounds it.

A worker retires, handing its slot to a fresh process, at the first of: it has run
``resources.max_trials_per_worker`` trials (none with ``auto``); its mappings plus twice the most
a trial has added so far would pass ``RETIRE_FRACTION`` of the kernel's limit (TensorFlow keeps
every program it compiled mapped until its process ends, and Linux stops a process at
``vm.max_map_count`` mappings); its memory after a trial plus the most a trial has added would
pass ``resources.max_worker_memory`` (``auto``: the trial's share of the host's memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from pipeline.base.tensorflow_private import unregister_custom_gradients

MAPS = Path("/proc/self/maps")
MAP_LIMIT = Path("/proc/sys/vm/max_map_count")
STATUS = Path("/proc/self/status")
# Room left under the limit for what the process maps besides compiled programs (data copies,
# thread stacks, a final trial bigger than the ones before).
RETIRE_FRACTION = 0.8


def memory_maps() -> int:
    """How many memory mappings this process has (0 where /proc does not tell)."""
    try:
        with MAPS.open("rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


def map_limit() -> int:
    """The kernel's limit on a process's memory mappings (0 where /proc does not tell)."""
    try:
        return int(MAP_LIMIT.read_text().strip())
    except (OSError, ValueError):
        return 0


def resident_mb() -> float:
    """This process's resident memory (RSS) in MiB (0 where /proc does not tell)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def release_trial(before: frozenset[str]) -> int:
    """Drop the gradient functions ``tf.custom_gradient`` registered since ``before``
    (``tensorflow_private.registered_gradients``), and with them the graphs of a trial that has
    ended (its models gone, Keras' session cleared): nothing traces those graphs again, and each
    trial's own traces register their own. Returns how many."""
    return unregister_custom_gradients(before)


class WorkerState(NamedTuple):
    """A worker's memory mappings and resident memory (MiB) at one moment."""

    maps: int
    rss_mb: float


@dataclass
class Lifespan:
    """One worker process's trials, mappings and memory, and whether (and why) it should retire.

    ``max_rss_mb``: the memory it may hold (None: no limit known)."""

    max_trials: int | Literal["auto"] = "auto"
    max_rss_mb: float | None = None
    trials: int = 0
    largest_growth: int = 0  # mappings
    largest_rss_growth: float = 0.0
    _at_start: WorkerState = WorkerState(0, 0.0)

    def start_trial(self) -> None:
        self.trials += 1
        self._at_start = WorkerState(memory_maps(), resident_mb())

    def observe(self) -> WorkerState:
        """The mappings and memory now; remembers the most one trial has added to each."""
        state = WorkerState(memory_maps(), resident_mb())
        self.largest_growth = max(self.largest_growth, state.maps - self._at_start.maps)
        self.largest_rss_growth = max(self.largest_rss_growth, state.rss_mb - self._at_start.rss_mb)
        return state

    def retire_reason(self, state: WorkerState) -> str:
        """Why this process, in ``state`` now (``observe``), should run no further trial; "" when
        it may run another."""
        if self.max_trials != "auto" and self.trials >= self.max_trials:
            return f"ran {self.trials} trial{'s' if self.trials > 1 else ''} (resources.max_trials_per_worker)"
        limit = map_limit()
        if limit and state.maps + 2 * self.largest_growth > RETIRE_FRACTION * limit:
            return (
                f"{state.maps:,} memory mappings, and a trial has added up to {self.largest_growth:,}: two more "
                f"would pass {RETIRE_FRACTION:.0%} of the kernel's limit ({limit:,})"
            )
        if self.max_rss_mb is not None and state.rss_mb + self.largest_rss_growth > self.max_rss_mb:
            return (
                f"{state.rss_mb:,.0f} MiB resident, and a trial has added up to {self.largest_rss_growth:,.0f} "
                f"MiB: another would pass resources.max_worker_memory ({self.max_rss_mb:,.0f} MiB)"
            )
        return ""
