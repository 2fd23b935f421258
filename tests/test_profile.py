"""What a profiled epoch's trace says (pipeline.engine.profile), on events as TensorFlow's XSpace
holds them: self times summed over calls and folds, and the time no operation runs. The profiler
itself, and the reading of its file, run in test_rerun_e2e (`rerun --profile`)."""

from __future__ import annotations

import pytest

from pipeline.engine.profile import TRAIN_REGION, EpochProfile, OpTime, TraceTimes, op_name


def test_an_operation_is_named_without_its_instance_number_and_launches_are_no_operations():
    assert op_name("convolution.1", "", hlo=True) == "convolution"
    assert op_name("multiply_subtract_fusion.12", "", hlo=True) == "multiply_subtract_fusion"
    assert op_name("while_4/body/_463/GatherV2:GatherV2", "GatherV2", hlo=False) == "GatherV2"
    assert (
        op_name("while/StatefulPartitionedCall:StatefulPartitionedCall", "StatefulPartitionedCall", hlo=False) is None
    )
    assert (
        op_name("__inference_train_steps_12:__inference_train_steps_12", "__inference_train_steps_12", hlo=False)
        is None
    )
    assert op_name("ExecutorState::Process", "", hlo=False) is None
    assert op_name("end: convolution.1", "", hlo=False) is None


def thread(*events):
    """(name, operation, start, end) in microseconds, in the order they started."""
    return [(name, op, float(start), float(end)) for name, op, start, end in events]


# Two folds' steps: XLA's ops on the launching thread inside its executor's event, the other
# fold's convolution on a pool thread, TensorFlow ops after them, and the region the trainer marks.
MAIN = thread(
    (TRAIN_REGION, None, 0, 100),
    ("ExecutorState::Process", None, 0, 100),
    ("ThunkExecutor::Execute", None, 10, 50),
    ("convolution.1", "convolution", 12, 32),
    ("dot.3", "dot", 34, 40),
    ("GatherV2", "GatherV2", 60, 65),
    ("_MklNativeFusedConv2D", "_MklNativeFusedConv2D", 70, 80),
)
POOL = thread(("convolution", "convolution", 20, 30))


def times() -> TraceTimes:
    read = TraceTimes()
    read.add_thread(MAIN)
    read.add_thread(POOL)
    return read


def test_top_operations_add_every_call_of_every_fold_and_share_their_self_time():
    top = times().top_operations()
    assert [op.name for op in top] == ["convolution", "_MklNativeFusedConv2D", "dot", "GatherV2"]
    assert [op.self_s for op in top] == pytest.approx([30e-6, 10e-6, 6e-6, 5e-6])
    assert sum(op.share for op in top) == pytest.approx(1.0)
    assert top[0].share == pytest.approx(30 / 51)
    assert len(times().top_operations(2)) == 2


def test_self_time_leaves_out_the_events_inside_an_operation_on_its_thread():
    read = TraceTimes()
    read.add_thread(thread(("fusion.1", "fusion", 0, 10), ("MemoryAllocation", None, 2, 5), ("copy", "copy", 12, 13)))
    assert dict(read.self_us) == pytest.approx({"fusion": 7.0, "copy": 1.0})


def test_the_host_between_launches_is_the_share_of_the_training_no_operation_covers():
    read = times()
    assert read.regions[TRAIN_REGION] == [(0.0, 100.0)]
    # operations cover 12-32 (the convolutions overlap on two threads), 34-40, 60-65 and 70-80: 41 of 100
    assert read.idle_share(read.regions[TRAIN_REGION]) == pytest.approx(1 - 41 / 100)
    assert read.idle_share([(60.0, 70.0)]) == pytest.approx(0.5)
    assert read.idle_share([(0.0, 10.0), (60.0, 70.0)]) == pytest.approx(0.75)


def test_a_profile_says_its_parts_its_top_operations_the_hosts_share_and_how_to_open_its_trace(tmp_path):
    logdir = tmp_path / "my profiles"
    profile = EpochProfile(
        epoch=2,
        wall_s=2.0,
        train_s=1.5,
        validation_s=0.3,
        gap_s=0.2,
        profiler_start_s=0.05,
        top_ops=(OpTime("convolution", 0.9, 0.6), OpTime("dot", 0.6, 0.4)),
        host_between_share=0.25,
        logdir=logdir,
        trace_file=logdir / "plugins/profile/1/host.xplane.pb",
    )
    lines = profile.lines()
    assert lines[:4] == [
        "profile of epoch 2: its wall clock 2.000 s = training launches 1.500 s (75%), validation 0.300 s (15%), "
        "gap before the epoch 0.200 s (10%); the gap holds the profiler's start, 0.050 s",
        "top operations by self time, all folds (share of all operations' self time):",
        "     0.9000 s   60.0%  convolution",
        "     0.6000 s   40.0%  dot",
    ]
    assert lines[4].startswith("no operation runs for 25% of the training launches' time")
    assert lines[5].startswith(f"trace: {logdir}/plugins/profile/1/host.xplane.pb; open it with: ")
    assert lines[5].endswith(f"xprof --logdir='{logdir}' --port=6006")  # quoted: the path has a space
