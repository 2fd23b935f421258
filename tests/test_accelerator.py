"""The GPU a process computes on, as the compile cache keys it and a trial's plan records it,
with ``nvidia-smi``, the CUDA/cuDNN wheels and TensorFlow's build information spied (no GPU here)."""

from __future__ import annotations

import subprocess
from importlib import metadata

import pytest

from pipeline.base import accelerator, compile_cache
from pipeline.base.accelerator import GpuIdentity, UnknownGpu
from pipeline.contract.plan import TrialPlan
from pipeline.engine import runner

A100 = "0, GPU-aaaa, NVIDIA A100-SXM4-80GB, 8.0, 550.54.15\n1, GPU-bbbb, NVIDIA A100-SXM4-80GB, 8.0, 550.54.15\n"
H100 = "0, GPU-cccc, NVIDIA H100 80GB HBM3, 9.0, 550.54.15\n"
WHEELS = {accelerator.CUDA_DISTRIBUTION: "12.9.79", accelerator.CUDNN_DISTRIBUTION: "9.10.2.21"}


@pytest.fixture
def machine(monkeypatch):
    """A machine whose nvidia-smi answers ``machine.smi`` (None: not installed), with GPU device
    files or not, and the CUDA/cuDNN wheels of ``machine.wheels``; ``machine.calls`` its commands."""

    class Machine:
        smi: str | None = A100
        present = True
        wheels = dict(WHEELS)
        calls: list[list[str]] = []

    def run(command, **kwargs):
        Machine.calls.append(command)
        if Machine.smi is None:
            raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")
        return subprocess.CompletedProcess(command, 0, Machine.smi, "")

    def version(distribution):
        if distribution in Machine.wheels:
            return Machine.wheels[distribution]
        raise metadata.PackageNotFoundError(distribution)

    monkeypatch.setattr(accelerator.subprocess, "run", run)
    monkeypatch.setattr(accelerator, "gpus_present", lambda: Machine.present)
    monkeypatch.setattr(accelerator.metadata, "version", version)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(accelerator.DETERMINISM_VARIABLE, raising=False)
    return Machine


def test_the_gpus_a_process_may_use_are_named_with_driver_cuda_and_cudnn(machine, monkeypatch):
    import tensorflow as tf

    identity = accelerator.gpu_identity()
    assert identity == GpuIdentity("NVIDIA A100-SXM4-80GB (compute 8.0)", "550.54.15", "12.9.79", "9.10.2.21")
    assert identity.describe() == "NVIDIA A100-SXM4-80GB (compute 8.0), driver 550.54.15, CUDA 12.9.79, cuDNN 9.10.2.21"
    # Ray's CUDA_VISIBLE_DEVICES, by index or UUID: only those GPUs count (nvidia-smi lists all).
    machine.smi = A100 + H100.replace("0,", "2,", 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert accelerator.gpu_identity().model == "NVIDIA H100 80GB HBM3 (compute 9.0)"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa")
    assert accelerator.gpu_identity().model == "NVIDIA A100-SXM4-80GB (compute 8.0)"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert accelerator.gpu_identity() is None  # hidden (a gpu: 0 worker)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    # Without the wheels: the versions TensorFlow was built with.
    machine.wheels = {}
    monkeypatch.setattr(tf.sysconfig, "get_build_info", lambda: {"cuda_version": "12.5.1", "cudnn_version": "9"})
    assert accelerator.cuda_versions() == ("12.5.1", "9")
    monkeypatch.setattr(tf.sysconfig, "get_build_info", lambda: {"is_cuda_build": False})
    assert accelerator.cuda_versions() == ("unknown", "unknown")


def test_a_gpu_nvidia_smi_cannot_name_is_unknown_and_a_machine_without_gpus_has_none(machine):
    machine.smi = None
    with pytest.raises(UnknownGpu, match="nvidia-smi failed"):
        accelerator.gpu_identity()
    machine.present = False
    assert accelerator.gpu_identity() is None
    machine.smi, machine.present = "", True
    with pytest.raises(UnknownGpu, match="lists none"):
        accelerator.gpu_identity()


def test_the_compile_cache_store_is_keyed_by_gpu_model_driver_cuda_cudnn_and_determinism(machine, monkeypatch):
    # What tf.config.experimental.enable_op_determinism() sets (spied: it cannot be unset).
    from tensorflow.python.framework import config as determinism

    def store(gpus=1):
        return compile_cache.store_name(compile_cache.device_kind(gpus))

    monkeypatch.setattr(determinism, "is_op_determinism_enabled", lambda: False)
    here = store()
    assert compile_cache.device_kind(1).startswith("gpu:NVIDIA A100-SXM4-80GB (compute 8.0), driver 550.54.15")
    assert compile_cache.device_kind(0).startswith("cpu:")  # a worker of gpu: 0 compiles for its CPU
    stores = {here}
    machine.smi = H100
    stores.add(store())
    machine.smi = A100.replace("550.54.15", "560.28.03")
    stores.add(store())
    machine.smi, machine.wheels = A100, {**WHEELS, accelerator.CUDNN_DISTRIBUTION: "9.1.0.70"}
    stores.add(store())
    machine.wheels = {**WHEELS, accelerator.CUDA_DISTRIBUTION: "12.4.127"}
    stores.add(store())
    machine.wheels = dict(WHEELS)
    assert store() == here
    monkeypatch.setenv(accelerator.DETERMINISM_VARIABLE, "1")
    stores.add(store())
    monkeypatch.delenv(accelerator.DETERMINISM_VARIABLE)
    monkeypatch.setattr(determinism, "is_op_determinism_enabled", lambda: True)
    assert store() in stores  # enable_op_determinism() and TF_DETERMINISTIC_OPS=1: one setting
    assert len(stores) == 6


def test_the_compile_cache_is_off_with_a_notice_where_the_gpu_cannot_be_identified(machine, monkeypatch):
    activated, deactivated = [], []
    monkeypatch.setattr(compile_cache, "activate", lambda *, device_kind: activated.append(device_kind))
    monkeypatch.setattr(compile_cache, "deactivate", lambda: deactivated.append(True))
    machine.smi = None
    notice = runner.use_compile_cache(gpus=0.5, wanted=True)
    assert notice.startswith("compile cache off: the GPU cannot be identified (nvidia-smi failed: ")
    assert activated == [] and deactivated == [True]
    # No GPU on the machine: the trial trains on CPU, and its CPU is what the cache is keyed by.
    machine.present = False
    assert runner.use_compile_cache(gpus=0.5, wanted=True) == ""
    assert activated and activated[0].startswith("cpu:")
    machine.smi, machine.present = A100, True
    assert runner.use_compile_cache(gpus=1, wanted=True) == "" and activated[-1].startswith("gpu:NVIDIA A100")


def test_a_rerun_names_another_gpu_or_other_versions_among_its_differences():
    from pipeline.contract.plan import ThreadPlan, plan_differences

    recorded = TrialPlan(
        jit_compile=True,
        steps_per_launch=1,
        layout="stacked",
        reason="r",
        threads=ThreadPlan(1, 1),
        device="/GPU:0",
        stop_test="per_epoch",
        stacked_convolutions="grouped",
        gpu=GpuIdentity("NVIDIA A100-SXM4-80GB (compute 8.0)", "550.54.15", "12.9.79", "9.10.2.21"),
    )
    assert TrialPlan.from_dict(recorded.as_dict()) == recorded
    now = TrialPlan.from_dict(
        {
            **recorded.as_dict(),
            "deterministic_ops": True,
            "gpu": {
                "model": "NVIDIA H100 80GB HBM3 (compute 9.0)",
                "driver": "560.28.03",
                "cuda": "12.9.79",
                "cudnn": "9.1.0.70",
            },
        }
    )
    assert plan_differences(recorded, now) == [
        "GPU NVIDIA A100-SXM4-80GB (compute 8.0) -> NVIDIA H100 80GB HBM3 (compute 9.0)",
        "driver 550.54.15 -> 560.28.03",
        "cuDNN 9.10.2.21 -> 9.1.0.70",
        "deterministic ops off -> on",
    ]
    assert plan_differences(recorded, recorded) == []
