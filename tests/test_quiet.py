"""The terminal shows foldsweep's own lines: TensorFlow's warning that a function traced again is
dropped for foldsweep's functions, which trace once per fold by design, and kept for the
researcher's."""

from __future__ import annotations

import logging

from pipeline.base.quiet import OwnRetracingFiltered

WARNING = (
    "5 out of the last 5 calls to <function {name} at 0x7f4915235c60> triggered tf.function retracing. "
    "Tracing is expensive and the excessive number of tracings could be due to (1) creating @tf.function "
    "repeatedly in a loop"
)


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("tensorflow", logging.WARNING, "polymorphic_function.py", 157, message, None, None)


def test_a_retracing_warning_is_dropped_for_foldsweeps_functions_only():
    import pipeline.engine.fold_engine  # noqa: F401  (where fold_steps is defined)

    shown = OwnRetracingFiltered().filter
    assert not shown(record(WARNING.format(name="fold_steps.<locals>.evaluate_batch")))
    assert shown(record(WARNING.format(name="my_augment.<locals>.step")))
    assert shown(record(WARNING.format(name="train_step")))  # a name foldsweep's modules do not define
    assert shown(record("an unrelated warning from fold_steps"))
