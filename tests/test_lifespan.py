"""When a worker process retires (after N trials, as its mappings near the kernel's limit, or as
its memory nears its budget), and what a trial leaves behind that the next one does not inherit."""

from __future__ import annotations

import gc

import pytest

from pipeline.base.tensorflow_private import registered_gradients
from pipeline.engine import lifespan
from pipeline.engine.lifespan import Lifespan, WorkerState


@pytest.fixture
def no_map_limit(monkeypatch):
    monkeypatch.setattr(lifespan, "map_limit", lambda: 0)  # /proc does not tell: never retire on maps


def test_a_worker_retires_after_its_trials(no_map_limit):
    life = Lifespan(max_trials=2)
    life.start_trial()
    assert life.retire_reason(life.observe()) == ""
    life.start_trial()
    assert life.retire_reason(life.observe()) == "ran 2 trials (resources.max_trials_per_worker)"


def test_auto_retires_before_the_mapping_limit(monkeypatch):
    life = Lifespan()
    life.start_trial()
    state = life.observe()
    assert state.maps > 0 and life.retire_reason(state) == ""  # far under the real limit
    life.largest_growth = 1000  # a trial added 1000 mappings: two more must fit under 80% of the limit
    monkeypatch.setattr(lifespan, "map_limit", lambda: int((state.maps + 2000) / 0.8) + 1)
    assert life.retire_reason(state) == ""
    monkeypatch.setattr(lifespan, "map_limit", lambda: int((state.maps + 2000) / 0.8) - 1)
    assert "memory mappings, and a trial has added up to 1,000: two more would pass 80%" in life.retire_reason(state)
    monkeypatch.setattr(lifespan, "map_limit", lambda: 0)
    assert life.retire_reason(state) == ""


def test_a_worker_retires_before_its_memory_passes_its_budget(no_map_limit, monkeypatch):
    """Made-up figures: each trial adds to the worker's resident memory; the worker retires once
    its memory after a trial plus the most a trial has added would pass the budget."""
    resident = iter(
        [
            1000.0,
            1100.0,  # trial 1: +100 MiB
            1100.0,
            1150.0,  # trial 2: +50, and 1150 + 100 = 1250 fits under 1300
            1150.0,
            1220.0,
        ]
    )  # trial 3: 1220 + 100 would pass 1300
    monkeypatch.setattr(lifespan, "resident_mb", lambda: next(resident))
    life = Lifespan(max_rss_mb=1300)
    life.start_trial()
    assert life.retire_reason(life.observe()) == "" and life.largest_rss_growth == 100
    life.start_trial()
    state = life.observe()
    assert state == WorkerState(state.maps, 1150.0) and life.retire_reason(state) == ""
    life.start_trial()
    assert life.retire_reason(life.observe()) == (
        "1,220 MiB resident, and a trial has added up to 100 MiB: another "
        "would pass resources.max_worker_memory (1,300 MiB)"
    )
    assert Lifespan(max_rss_mb=None).retire_reason(WorkerState(0, 10**9)) == ""  # no budget known: no limit


@pytest.mark.training
def test_a_released_trial_leaves_no_graph_behind():
    """Keras' optimizer registers a custom gradient at every trace of a step (its all-reduce),
    which TensorFlow's gradient registry keeps, with the step's graph, for the life of the process."""
    import keras
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.framework import func_graph

    def graphs() -> int:
        gc.collect()
        return sum(isinstance(obj, func_graph.FuncGraph) for obj in gc.get_objects())

    def one_trial() -> None:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.Adam()
        optimizer.build(model.trainable_variables)

        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

        step(np.ones((3, 4), np.float32))

    keras.backend.clear_session(free_memory=False)
    baseline = graphs()
    before = registered_gradients()
    one_trial()
    keras.backend.clear_session(free_memory=False)
    assert graphs() > baseline, "the registry keeps the trial's graph"
    assert lifespan.release_trial(before) >= 1
    assert graphs() == baseline
    assert registered_gradients() == before
