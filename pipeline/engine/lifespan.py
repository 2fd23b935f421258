"""How long a worker process lives: the trials it runs, and its memory mappings against the
kernel's limit.

TensorFlow keeps every XLA program it compiled mapped until its process ends (about 600
mappings per XLA-compiled MNIST-1D trial of 3 folds, 1,900 with 8 steps per launch), and Linux
stops a process at ``vm.max_map_count`` mappings (65,530 by default): a worker that Ray Tune
reuses for trial after trial would abort with ``LLVM ERROR: Unable to allocate section
memory``. So a worker retires, handing its slot to a fresh process, once it has run
``resources.max_trials_per_worker`` trials, or (``auto``) once its mappings plus twice the most
a trial has added so far would pass ``RETIRE_FRACTION`` of the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

MAPS = Path("/proc/self/maps")
MAP_LIMIT = Path("/proc/sys/vm/max_map_count")
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


@dataclass
class Lifespan:
    """One worker process's trials and mappings, and whether it should retire."""

    max_trials: int | Literal["auto"] = "auto"
    trials: int = 0
    largest_growth: int = 0
    _maps_at_start: int = 0

    def start_trial(self) -> None:
        self.trials += 1
        self._maps_at_start = memory_maps()

    def observe(self) -> int:
        """The mappings now; remembers the most one trial has added."""
        maps = memory_maps()
        self.largest_growth = max(self.largest_growth, maps - self._maps_at_start)
        return maps

    def should_retire(self, maps: int) -> bool:
        """Whether this process, with ``maps`` mappings now (``observe``), should run no further
        trial."""
        if self.max_trials != "auto":
            return self.trials >= self.max_trials
        limit = map_limit()
        return bool(limit) and maps + 2 * self.largest_growth > RETIRE_FRACTION * limit
