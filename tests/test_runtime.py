"""TensorFlow's process-wide settings: applied before it starts, or refused aloud."""

from __future__ import annotations

import os

import pytest

from pipeline.contract.plan import ThreadPlan
from pipeline.engine.runtime import (
    GPU_CONTEXT_RESERVE_MB,
    DeviceError,
    GpuMemory,
    ThreadsError,
    configure_devices,
    configure_threads,
    hide_gpus,
    threads_in_effect,
)


def test_thread_pools_that_cannot_be_applied_raise():
    import tensorflow as tf

    float(tf.reduce_sum(tf.ones([2])))  # TensorFlow has started in this process
    running = threads_in_effect()
    configure_threads(running)  # what already runs needs no change
    other = ThreadPlan(intra_op=running.intra_op + 3, inter_op=running.inter_op + 2)
    with pytest.raises(
        ThreadsError,
        match=rf"already runs in this process with {running.describe()} threads, and "
        rf"this trial needs {other.describe()}",
    ):
        configure_threads(other)
    assert threads_in_effect() == running


def test_cpu_without_gpu_gets_a_notice():
    assert "training on CPU" in configure_devices(0.5)


@pytest.fixture
def two_gpus(monkeypatch):
    """TensorFlow's device settings as on a machine with two GPUs, none started: each call is
    recorded (with ``CUDA_VISIBLE_DEVICES`` as CUDA would read it then) and none applied."""
    import tensorflow as tf

    from pipeline.engine import runtime

    gpus = [tf.config.PhysicalDevice(name=f"/physical_device:GPU:{i}", device_type="GPU") for i in range(2)]
    calls = []

    def list_physical_devices(device_type=None):
        calls.append(("list", device_type, os.environ.get("CUDA_VISIBLE_DEVICES")))
        return gpus if device_type == "GPU" else []

    monkeypatch.setattr(tf.config, "list_physical_devices", list_physical_devices)
    monkeypatch.setattr(
        tf.config,
        "set_visible_devices",
        lambda devices, device_type=None: calls.append(("visible", list(devices), device_type)),
    )
    monkeypatch.setattr(
        tf.config,
        "set_logical_device_configuration",
        lambda device, logical: calls.append(("limit", device.name, [config.memory_limit for config in logical])),
    )
    monkeypatch.setattr(
        tf.config.experimental,
        "set_memory_growth",
        lambda device, enable: calls.append(("growth", device.name, enable)),
    )
    monkeypatch.setattr(runtime, "_device_notice", None)
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    return calls


def test_a_worker_without_gpus_hides_them_before_tensorflow_starts(two_gpus, monkeypatch):
    """Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for an actor that asked for no GPU (ray#54868):
    the worker's set-up hides them itself, before it copies the data to a device."""
    from types import SimpleNamespace

    import pipeline.base.compile_cache
    import pipeline.engine.resident
    import pipeline.inputs.hypermodel
    from pipeline.engine.runner import set_up_worker

    monkeypatch.setattr(pipeline.base.compile_cache, "deactivate", lambda: None)
    monkeypatch.setattr(pipeline.engine.resident, "resident_data", lambda *args, **kwargs: two_gpus.append(("data",)))
    monkeypatch.setattr(pipeline.inputs.hypermodel, "load_builder", lambda *args: None)
    settings = SimpleNamespace(
        gpus=0.0,
        train=SimpleNamespace(compile_cache=False),
        dataset_fingerprint="f",
        experiment_path="experiment.py",
        experiment_attr="build",
    )
    worker = set_up_worker(settings, x=None, y=None, threads=threads_in_effect())
    # CUDA found no device when TensorFlow first asked (so it made no context on any), and
    # TensorFlow keeps off any it would have found; the processes this one starts see them all.
    assert two_gpus == [("list", "GPU", ""), ("visible", [], "GPU"), ("data",)]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert worker.device_notice == "resources.gpu is 0: this worker's TensorFlow sees no GPU, training on CPU"


@pytest.mark.parametrize(
    ("fraction", "memory", "limit"),
    [
        (0.25, GpuMemory(total_mb=16_000, free_mb=15_500), 4_000 - GPU_CONTEXT_RESERVE_MB),
        (0.5, GpuMemory(total_mb=16_000, free_mb=3_000), 3_000 - GPU_CONTEXT_RESERVE_MB),  # others hold the rest
        (0.5, GpuMemory(total_mb=16_000, free_mb=None), 8_000 - GPU_CONTEXT_RESERVE_MB),
    ],
)
def test_a_fractional_slot_grows_up_to_a_ceiling_that_leaves_room_for_its_cuda_context(
    two_gpus, monkeypatch, fraction, memory, limit
):
    from pipeline.engine import runtime

    monkeypatch.setattr(runtime, "_gpu_memory", lambda: memory)
    notice = configure_devices(fraction)
    assert two_gpus[1:] == [("limit", f"/physical_device:GPU:{i}", [limit]) for i in range(2)]
    # TensorFlow's allocator takes growth from the environment over the limit's GPUOptions.
    assert os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert f"memory grows up to {limit} MiB ({GPU_CONTEXT_RESERVE_MB} MiB left for the CUDA context)" in notice
    assert configure_devices(fraction) == notice and len(two_gpus) == 3  # set once per process


@pytest.mark.parametrize(
    ("fraction", "memory", "notice"),
    [
        (1.0, GpuMemory(total_mb=16_000, free_mb=15_500), "GPU with memory growth"),
        (0.5, None, "GPU slot 0.5 of a GPU of unknown size (nvidia-smi did not answer): memory growth, no ceiling"),
    ],
)
def test_a_whole_gpu_or_one_of_unknown_size_grows(two_gpus, monkeypatch, fraction, memory, notice):
    from pipeline.engine import runtime

    monkeypatch.setattr(runtime, "_gpu_memory", lambda: memory)
    assert configure_devices(fraction) == notice
    assert two_gpus[1:] == [("growth", f"/physical_device:GPU:{i}", True) for i in range(2)]
    assert os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"


def test_a_slot_that_cannot_be_set_fails_with_the_reason(two_gpus, monkeypatch):
    import tensorflow as tf

    from pipeline.engine import runtime

    def started(device, logical):
        raise RuntimeError("Virtual devices cannot be modified after being initialized")

    monkeypatch.setattr(runtime, "_gpu_memory", lambda: GpuMemory(total_mb=16_000, free_mb=None))
    monkeypatch.setattr(tf.config, "set_logical_device_configuration", started)
    with pytest.raises(
        DeviceError,
        match=r"resources.gpu 0.25: TensorFlow has already set up the GPUs of this "
        r"process, so it can no longer be limited to its slot \(Virtual devices "
        r"cannot be modified after being initialized\)",
    ):
        configure_devices(0.25)


def test_gpus_that_cannot_be_hidden_fail_with_the_reason(two_gpus, monkeypatch):
    import tensorflow as tf

    def started(devices, device_type=None):
        raise RuntimeError("Visible devices cannot be modified after being initialized")

    monkeypatch.setattr(tf.config, "set_visible_devices", started)
    with pytest.raises(DeviceError, match=r"TensorFlow already runs on a GPU in this process \(Visible devices"):
        hide_gpus()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


@pytest.mark.training
@pytest.mark.parametrize("command", ["validate", "run"])
def test_the_driver_keeps_tensorflow_off_the_gpus(two_gpus, monkeypatch, write_spec, command):
    """The driver builds the default model in prepare (and trains the refit) with no GPU visible:
    every GPU's memory is the trials'; the local Ray it starts still sees the GPUs."""
    from typer.testing import CliRunner

    import pipeline.inputs.hypermodel
    import pipeline.sweep
    from pipeline.base.errors import FoldsweepError
    from pipeline.cli import app

    load_experiment = pipeline.inputs.hypermodel.load_experiment

    def loading(*args, **kwargs):
        two_gpus.append(("build",))
        return load_experiment(*args, **kwargs)

    def run_sweep(*args, **kwargs):
        two_gpus.append(("ray", os.environ.get("CUDA_VISIBLE_DEVICES")))
        raise FoldsweepError("stopped before Ray starts")

    monkeypatch.setattr(pipeline.inputs.hypermodel, "load_experiment", loading)
    monkeypatch.setattr(pipeline.sweep, "run_sweep", run_sweep)
    result = CliRunner().invoke(app, [command, str(write_spec())])
    assert two_gpus[:2] == [("list", "GPU", ""), ("visible", [], "GPU")], result.output
    assert ("build",) in two_gpus[2:], result.output  # the default model is built after
    if command == "run":
        assert two_gpus[-1] == ("ray", "0,1") and "stopped before Ray starts" in result.output
    else:
        assert result.exit_code == 0, result.output
