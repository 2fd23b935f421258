"""When this process began loading foldsweep (``time.perf_counter``), imported first of all its
modules (``pipeline/__init__``), and whether it loaded it ahead of any trial.

A Ray worker loads foldsweep, and with it TensorFlow and Keras, as it starts
(``pipeline.engine.preload``) or when it receives its first trial. A worker started for its
trial counts that loading in the trial's time account, from ``LOADED_AT``. One started ahead, as
the driver connected, loaded it while the driver still prepared the sweep (the sweep's start-up):
its first trial's account starts at the trial's set-up (``first_trial_started``)."""

import time

LOADED_AT = time.perf_counter()
_loaded_ahead = False


def load_ahead() -> None:
    """Mark this process as loading foldsweep ahead of any trial."""
    global _loaded_ahead
    _loaded_ahead = True


def first_trial_started(now: float) -> float:
    """When this process's first trial started, for a trial that starts at ``now``."""
    return now if _loaded_ahead else min(LOADED_AT, now)
