"""Device-resident data: each worker process copies a dataset to its device once and keeps it.

Keyed by the dataset fingerprint, so a process that runs many trials of a sweep (Ray Tune
reuses actors) pays the host-to-device copy once; trials then gather their batches from these
tensors on the device.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

import numpy as np

# How many host-to-device copies of a dataset this process has made (what the tests count).
_transfers = 0
_resident: dict[str, "ResidentData"] = {}
_device_notice: str | None = None


@dataclass(frozen=True)
class ResidentData:
    fingerprint: str
    device: str
    x: object  # tf.Tensor (samples, ...) float32
    y: object  # tf.Tensor (samples,) int32


def transfers() -> int:
    return _transfers


def training_device() -> str:
    """'/GPU:0' when this process sees a GPU, else '/CPU:0'."""
    import tensorflow as tf

    return "/GPU:0" if tf.config.list_logical_devices("GPU") else "/CPU:0"


def resident_data(fingerprint: str, x: np.ndarray, y: np.ndarray) -> ResidentData:
    """The dataset on this process's training device, copied there on first use only."""
    global _transfers
    cached = _resident.get(fingerprint)
    if cached is not None:
        return cached
    import tensorflow as tf

    device = training_device()
    with tf.device(device):
        features = tf.constant(np.asarray(x, dtype=np.float32))
        labels = tf.constant(np.asarray(y, dtype=np.int32))
    _transfers += 1
    # One dataset per sweep is the norm; keeping older ones would only hold device memory.
    _resident.clear()
    _resident[fingerprint] = ResidentData(fingerprint, device, features, labels)
    return _resident[fingerprint]


def configure_devices(gpu_fraction: float) -> str:
    """Set GPU memory behaviour before TensorFlow initialises its devices in this process.

    A fractional slot (``gpu_fraction`` < 1) gets a memory limit of that fraction of the device
    when the device size is known, else memory growth, so trials packed onto one GPU do not
    take each other's memory. Returns a one-line notice of what was done.
    """
    global _device_notice
    if _device_notice is not None:
        return _device_notice
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        _device_notice = "no GPU visible to this worker: training on CPU"
        return _device_notice
    total_mb = _gpu_memory_mb()
    try:
        for gpu in gpus:
            if 0 < gpu_fraction < 1 and total_mb:
                limit = int(gpu_fraction * total_mb)
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit)])
                _device_notice = f"GPU slot: {gpu_fraction:g} of {total_mb} MB -> memory limit {limit} MB"
            else:
                tf.config.experimental.set_memory_growth(gpu, True)
                _device_notice = "GPU with memory growth"
    except RuntimeError:
        _device_notice = "GPU already initialised in this process; memory settings unchanged"
    return _device_notice


def _gpu_memory_mb() -> int | None:
    """Total memory of the first visible GPU, from nvidia-smi (which Ray's device mask respects)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    command = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    if visible:
        command += ["-i", visible]
    try:
        output = subprocess.run(command, capture_output=True, text=True, timeout=10, check=True).stdout
        return int(output.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
