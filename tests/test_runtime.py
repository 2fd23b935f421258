"""TensorFlow's process-wide settings: applied before it starts, or refused aloud."""

from __future__ import annotations

import pytest

from pipeline.contract.plan import ThreadPlan
from pipeline.engine.runtime import ThreadsError, configure_devices, configure_threads, threads_in_effect


def test_thread_pools_that_cannot_be_applied_raise():
    import tensorflow as tf

    float(tf.reduce_sum(tf.ones([2])))  # TensorFlow has started in this process
    running = threads_in_effect()
    configure_threads(running)  # what already runs needs no change
    other = ThreadPlan(intra_op=running.intra_op + 3, inter_op=running.inter_op + 2)
    with pytest.raises(ThreadsError, match=rf"already runs in this process with {running.describe()} threads, and "
                                           rf"this trial needs {other.describe()}"):
        configure_threads(other)
    assert threads_in_effect() == running


def test_cpu_without_gpu_gets_a_notice():
    assert "training on CPU" in configure_devices(0.5)
