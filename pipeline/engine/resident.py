"""Device-resident data: each worker process copies a dataset to its device once and keeps it.

Keyed by the dataset fingerprint, so a process that runs many trials of a sweep (Ray Tune
reuses actors) pays the host-to-device copy once; trials then gather their batches from these
tensors on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import tensorflow as tf

# How many host-to-device copies of a dataset this process has made (what the tests count).
_transfers = 0
_resident: dict[str, ResidentData] = {}


@dataclass(frozen=True)
class ResidentData:
    fingerprint: str
    device: str
    x: tf.Tensor  # (samples, ...) float32
    y: tf.Tensor  # (samples, ...): class labels of integer_dtype(device), or float32 regression targets
    one_hot: bool = False  # the labels were stored as one-hot rows (``Dataset.one_hot``)

    @property
    def index_dtype(self) -> type[np.signedinteger[Any]]:
        """The dtype of index batches sent to this data's device (``integer_dtype``)."""
        return integer_dtype(self.device)


def integer_dtype(device: str) -> type[np.signedinteger[Any]]:
    """int64 on a GPU, int32 on CPU. TensorFlow keeps an int32 tensor placed on a GPU in host
    memory (its GPU kernels take int32 from the host), so int32 labels and index batches would
    cross to the device at every launch that gathers them; int64 ones stay on the device. The
    steps cast the gathered labels to int32 (``step_labels``), where a GPU's compiled step holds
    them, so that the loss sees the labels it sees on CPU."""
    return np.int64 if "GPU" in device else np.int32


def step_labels(labels: tf.Tensor) -> tf.Tensor:
    """Gathered labels as the loss sees them on every device: class labels as int32 (int64 on a
    GPU, ``integer_dtype``), regression targets unchanged."""
    import tensorflow as tf

    return tf.cast(labels, tf.int32) if labels.dtype.is_integer else labels


def transfers() -> int:
    return _transfers


def training_device() -> str:
    """'/GPU:0' when this process sees a GPU, else '/CPU:0'."""
    import tensorflow as tf

    return "/GPU:0" if tf.config.list_logical_devices("GPU") else "/CPU:0"


def resident_data(fingerprint: str, x: np.ndarray, y: np.ndarray, *, one_hot: bool = False) -> ResidentData:
    """The dataset on this process's training device, copied there on first use only (``one_hot``:
    the labels ``y`` holds as class indices were one-hot rows)."""
    global _transfers
    cached = _resident.get(fingerprint)
    if cached is not None:
        return cached
    import tensorflow as tf

    device = training_device()
    with tf.device(device):
        features = tf.constant(np.asarray(x, dtype=np.float32))
        # Regression targets stay floats (an int cast would truncate them); class labels are integers.
        targets = np.asarray(y)
        labels = tf.constant(targets.astype(np.float32 if targets.dtype.kind == "f" else integer_dtype(device)))
    _transfers += 1
    # One dataset per sweep is the norm; keeping older ones would only hold device memory.
    _resident.clear()
    _resident[fingerprint] = ResidentData(fingerprint, device, features, labels, one_hot=one_hot)
    return _resident[fingerprint]
