"""Device-resident data: each worker process copies a dataset to its device once and keeps it.

Keyed by the dataset fingerprint, so a process that runs many trials of a sweep (Ray Tune
reuses actors) pays the host-to-device copy once; trials then gather their batches from these
tensors on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# How many host-to-device copies of a dataset this process has made (what the tests count).
_transfers = 0
_resident: dict[str, "ResidentData"] = {}


@dataclass(frozen=True)
class ResidentData:
    fingerprint: str
    device: str
    x: object  # tf.Tensor (samples, ...) float32
    y: object  # tf.Tensor (samples, ...): int32 class labels, or float32 regression targets


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
        # Regression targets stay floats (an int cast would truncate them); labels are int32.
        labels = tf.constant(np.asarray(y, dtype=np.float32 if np.asarray(y).dtype.kind == "f" else np.int32))
    _transfers += 1
    # One dataset per sweep is the norm; keeping older ones would only hold device memory.
    _resident.clear()
    _resident[fingerprint] = ResidentData(fingerprint, device, features, labels)
    return _resident[fingerprint]
