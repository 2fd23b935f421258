"""What a profiled epoch's trace says (pipeline.engine.profile), on trace events as TensorFlow's
converter writes them: self times summed over calls and folds, and the time no operation runs.
The profiler itself runs in test_rerun_e2e (`rerun --profile`)."""

from __future__ import annotations

import pytest

from pipeline.engine.profile import TRAIN_REGION, idle_share, op_name, regions, self_times, top_operations


def event(name, ts, dur, *, tid=1, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid, "args": args}


def hlo(name, ts, dur, *, tid=1):
    return event(name, ts, dur, tid=tid, hlo_op=name, hlo_module="a_inference_train_steps")


# Two folds' steps: a launch holding XLA's ops on the launching thread, one op on a pool thread,
# TensorFlow ops around it, and the region the trainer marks.
EVENTS = [
    event(TRAIN_REGION, 0, 100, tid=1),
    event("ExecutorState::Process", 0, 100, tid=1),
    event("__inference_train_steps_12", 10, 40, tid=1, is_eager="0"),
    hlo("convolution.1", 12, 20, tid=1),
    hlo("dot.3", 34, 6, tid=1),
    hlo("convolution", 20, 10, tid=2),  # the other fold's, on a pool thread
    event("GatherV2", 60, 5, tid=1, is_eager="0"),
    event("_MklNativeFusedConv2D", 70, 10, tid=1, is_eager="0"),
    {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1, "args": {"name": "python"}},
]


def test_an_operation_is_named_without_its_instance_number_and_launches_are_no_operations():
    assert op_name(hlo("convolution.1", 0, 1)) == "convolution"
    assert op_name(hlo("multiply_subtract_fusion.12", 0, 1)) == "multiply_subtract_fusion"
    assert op_name(event("GatherV2", 0, 1, is_eager="0")) == "GatherV2"
    assert op_name(event("__inference_train_steps_12", 0, 1, is_eager="0")) is None
    assert op_name(event("XlaLaunch", 0, 1, is_eager="0")) is None
    assert op_name(event("ExecutorState::Process", 0, 1)) is None


def test_self_time_is_an_events_time_less_the_events_directly_inside_it_on_its_thread():
    times = {(e["name"], e["tid"]): t for e, t in self_times(EVENTS)}
    assert times[("__inference_train_steps_12", 1)] == pytest.approx(40 - 20 - 6)
    assert times[("convolution.1", 1)] == pytest.approx(20)
    assert times[("convolution", 2)] == pytest.approx(10)  # another thread: not inside the launch
    # the executor's event holds the launch and the two ops after it; the region holds it
    assert times[("ExecutorState::Process", 1)] == pytest.approx(100 - 40 - 5 - 10)
    assert times[(TRAIN_REGION, 1)] == pytest.approx(0)


def test_top_operations_add_every_call_of_every_fold_and_share_their_self_time():
    top = top_operations(EVENTS)
    assert [op.name for op in top] == ["convolution", "_MklNativeFusedConv2D", "dot", "GatherV2"]
    assert [op.self_s for op in top] == pytest.approx([30e-6, 10e-6, 6e-6, 5e-6])
    assert sum(op.share for op in top) == pytest.approx(1.0)
    assert top[0].share == pytest.approx(30 / 51)
    assert len(top_operations(EVENTS, top=2)) == 2


def test_the_host_between_launches_is_the_share_of_the_training_no_operation_covers():
    training = regions(EVENTS, TRAIN_REGION)
    assert training == [(0.0, 100.0)]
    # operations cover 12-32 (the convolutions overlap on two threads), 34-40, 60-65 and 70-80: 41 of 100
    assert idle_share(EVENTS, training) == pytest.approx(1 - 41 / 100)
    assert idle_share(EVENTS, [(60.0, 70.0)]) == pytest.approx(0.5)
