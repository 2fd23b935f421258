"""Which GPU a process computes on and with what: its model, the driver, CUDA and cuDNN, and
whether TensorFlow's ops are deterministic. All read without starting TensorFlow's devices
(which would fix its XLA flags): ``nvidia-smi`` for the GPUs this process may use, the installed
CUDA and cuDNN wheels (or TensorFlow's build information) for the libraries.

A compiled XLA program and a trial's float rounding depend on each of these, so the compile cache
keys its store by them and a trial's plan records them, for a rerun to name what changed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import subprocess
from dataclasses import dataclass
from importlib import metadata

from pipeline.base.tensorflow_private import op_determinism_enabled

DETERMINISM_VARIABLE = "TF_DETERMINISTIC_OPS"
# The wheels the `gpu` extra installs the CUDA runtime and cuDNN from (pylock.gpu.toml).
CUDA_DISTRIBUTION, CUDNN_DISTRIBUTION = "nvidia-cuda-runtime-cu12", "nvidia-cudnn-cu12"


@dataclass(frozen=True)
class GpuIdentity:
    """The GPUs a process may use and the software XLA compiles and runs for them with."""

    model: str  # "NVIDIA A100-SXM4-80GB (compute 8.0)", several joined by "; "
    driver: str
    cuda: str
    cudnn: str

    def describe(self) -> str:
        return f"{self.model}, driver {self.driver}, CUDA {self.cuda}, cuDNN {self.cudnn}"

    def differences(self, now: GpuIdentity) -> list[str]:
        """What of ``now`` differs from this identity, one ``what old -> new`` per part."""
        parts = (
            ("GPU", self.model, now.model),
            ("driver", self.driver, now.driver),
            ("CUDA", self.cuda, now.cuda),
            ("cuDNN", self.cudnn, now.cudnn),
        )
        return [f"{name} {old} -> {new}" for name, old, new in parts if old != new]


class UnknownGpu(Exception):
    """A GPU is present but cannot be identified (the reason is the message)."""


def gpus_present() -> bool:
    """Whether this machine exposes an NVIDIA GPU to processes (its device files), whatever
    ``nvidia-smi`` can tell about it."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def gpu_identity() -> GpuIdentity | None:
    """The identity of the GPUs this process may use (``CUDA_VISIBLE_DEVICES``, as Ray sets it),
    or None when it may use none.

    Raises:
        UnknownGpu: GPUs are present (or visible) but ``nvidia-smi`` cannot name them.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return None
    command = ["nvidia-smi", "--query-gpu=index,uuid,name,compute_cap,driver_version", "--format=csv,noheader"]
    try:
        listed = subprocess.run(command, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        if not gpus_present():
            return None
        raise UnknownGpu(f"nvidia-smi failed: {exc}") from None
    rows = [[field.strip() for field in line.split(",")] for line in listed.splitlines() if line.strip()]
    if visible is not None:
        wanted = {entry.strip() for entry in visible.split(",")}
        rows = [row for row in rows if row[0] in wanted or (len(row) > 1 and row[1] in wanted)]
    if any(len(row) != 5 for row in rows):
        raise UnknownGpu(f"nvidia-smi answered {listed.strip()!r}")
    if not rows:
        if gpus_present():
            raise UnknownGpu(f"nvidia-smi lists none of the GPUs {visible or 'present'}")
        return None
    models = "; ".join(sorted({f"{name} (compute {capability})" for _, _, name, capability, _ in rows}))
    drivers = "; ".join(sorted({driver for *_, driver in rows}))
    cuda, cudnn = cuda_versions()
    return GpuIdentity(model=models, driver=drivers, cuda=cuda, cudnn=cudnn)


def cuda_versions() -> tuple[str, str]:
    """(CUDA, cuDNN): the installed runtime wheels' versions, else those TensorFlow was built
    with, else "unknown"."""
    build: dict[str, object] = {}
    with contextlib.suppress(Exception):
        import tensorflow as tf

        build = dict(tf.sysconfig.get_build_info())

    def version(distribution: str, key: str) -> str:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(distribution)
        return str(build.get(key) or "unknown")

    return version(CUDA_DISTRIBUTION, "cuda_version"), version(CUDNN_DISTRIBUTION, "cudnn_version")


def deterministic_ops() -> bool:
    """Whether TensorFlow runs its ops deterministically in this process: ``TF_DETERMINISTIC_OPS``
    set, or ``tf.config.experimental.enable_op_determinism()`` called."""
    if os.environ.get(DETERMINISM_VARIABLE, "").strip().lower() in {"1", "true"}:
        return True
    import sys

    if "tensorflow" not in sys.modules:
        return False
    return op_determinism_enabled()
