"""A terminal that shows foldsweep's own output: TensorFlow's start-up lines filtered out.

TensorFlow 2.21 writes its start-up lines (absl's "before InitializeLog" warning, oneDNN's
notice, the CUDA-driver probe) from C++ straight to file descriptor 2, before its logging is set
up, and twice (``libtensorflow_framework`` and the profiler plugin each carry a copy of absl).
No environment variable reaches them (``TF_CPP_MIN_LOG_LEVEL`` only hides what comes later, and
turning oneDNN off would change the numbers), so the first import of TensorFlow runs with fd 2
captured, and every line that is not one of those known ones is written back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator

from pipeline.base.collector import collector_paused
from pipeline.base.deferred import KERAS_PLOTTING, KERAS_TUNER_TUNERS, deferred
from pipeline.base.keras_private import KERAS_SKLEARN_WRAPPERS

TENSORFLOW_START_UP = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:.]+ +\d+ (port\.cc|cudart_stub\.cc|cpu_feature_guard\.cc):\d+\] .*"
    r"|To enable the following instructions: .*rebuild TensorFlow with the appropriate compiler flags\.)$"
)


# TensorFlow's warning that calls of a function traced it again, and the function it names.
RETRACING_WARNING = re.compile(r"calls to <function (\w+)[.\s].* triggered tf\.function retracing")


class OwnRetracingFiltered(logging.Filter):
    """Drops TensorFlow's retracing warning where it names a function of foldsweep's: each fold
    engine traces its own evaluation, and a trial's checks their own steps, once each by design,
    which TensorFlow's count of traces per Python function takes for retracing. A warning of the
    researcher's own functions passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        found = RETRACING_WARNING.search(record.getMessage())
        return found is None or not _foldsweeps_own(found.group(1))


def _foldsweeps_own(name: str) -> bool:
    """Whether a function of that name is defined in one of foldsweep's loaded modules."""
    return any(
        module_name.split(".")[0] == "pipeline"
        and getattr(getattr(module, name, None), "__module__", "") == module_name
        for module_name, module in list(sys.modules.items())
    )


def quiet_environment() -> None:
    """Log levels for TensorFlow's later messages (a CPU-only machine's ``cuInit`` error, the
    CPU-feature notice), for this process and the Ray workers it starts, unless the user set them."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def import_tensorflow_and_keras() -> None:
    """Import TensorFlow, Keras and KerasTuner once, with TensorFlow's start-up lines filtered
    from standard error, the garbage collector paused while they load (``collector_paused``), and
    what they import for features foldsweep never calls (Keras' image galleries, the
    scikit-learn wrappers, KerasTuner's Bayesian and scikit-learn tuners) left to load when
    first used (``deferred``)."""
    if "keras" in sys.modules:
        return
    quiet_environment()
    unused = KERAS_PLOTTING + KERAS_SKLEARN_WRAPPERS + KERAS_TUNER_TUNERS
    with collector_paused(collect=False), filtered_stderr(TENSORFLOW_START_UP), deferred(unused):
        import keras  # noqa: F401  (Keras 3 loads TensorFlow, its backend, first)
        import keras_tuner  # noqa: F401  (here, in the deferral: it imports scikit-learn and SciPy's optimizers)
    logging.getLogger("tensorflow").addFilter(OwnRetracingFiltered())


@contextlib.contextmanager
def filtered_stderr(noise: re.Pattern[str]) -> Iterator[None]:
    """File descriptor 2 (C++ writes included) captured while the block runs, then written back
    without the lines ``noise`` matches."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile("w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not noise.match(line.rstrip("\n")):
                    sys.stderr.write(line)
            sys.stderr.flush()
