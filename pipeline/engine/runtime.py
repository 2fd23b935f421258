"""TensorFlow's process-wide configuration: thread pools and device memory.

Both must be set before TensorFlow starts in the process (its first op or device use), and
neither can change afterwards. A sweep's worker sets them in its set-up; ``foldsweep trial`` and
``rerun`` set them before they build anything, from the trial's record where there is one. A
setting that cannot be applied is an error, never a silent pass: a trial on other thread pools
sums floats in another order and walks another trajectory.
"""

from __future__ import annotations

import os
import subprocess

from pipeline.base.errors import FoldsweepError
from pipeline.contract.plan import ThreadPlan

_device_notice: str | None = None


class ThreadsError(FoldsweepError):
    """TensorFlow already runs in this process with other thread pools than a trial needs."""


def configure_threads(threads: ThreadPlan) -> None:
    """Size TensorFlow's thread pools for this process's trials.

    Raises:
        ThreadsError: TensorFlow has already started here with other thread pools.
    """
    import tensorflow as tf

    if threads_in_effect() == threads:
        return
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads.intra_op)
        tf.config.threading.set_inter_op_parallelism_threads(threads.inter_op)
    except RuntimeError:
        raise ThreadsError(
            f"TensorFlow already runs in this process with {threads_in_effect().describe()} threads, and this "
            f"trial needs {threads.describe()}: thread pools cannot change once TensorFlow has started, so run the "
            "trial in a fresh process") from None


def threads_in_effect() -> ThreadPlan:
    """The thread pools TensorFlow runs with in this process (0: TensorFlow's default)."""
    import tensorflow as tf

    return ThreadPlan(intra_op=tf.config.threading.get_intra_op_parallelism_threads(),
                      inter_op=tf.config.threading.get_inter_op_parallelism_threads())


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


# Of the host's memory, what trials may count on: Ray's object store and the driver take the rest.
HOST_MEMORY_FOR_TRIALS = 0.5


def memory_per_trial_mb(*, cpus: float, gpus: float, max_concurrent: int | None) -> tuple[int, str] | None:
    """The memory one trial can hold, in MiB, and where that figure comes from: its share of
    the GPU when it runs on one whose size is known, else its share of the host's memory among
    the trials that run side by side. None when neither is known."""
    if gpus > 0:
        total = _gpu_memory_mb()
        if total is None:
            return None
        share = min(gpus, 1.0)
        return int(total * share), f"{share:g} of a {total} MiB GPU"
    return host_memory_per_trial_mb(cpus=cpus, max_concurrent=max_concurrent)


def host_memory_per_trial_mb(*, cpus: float, max_concurrent: int | None) -> tuple[int, str] | None:
    """A trial's share of the host's memory, in MiB, among the trials that run side by side, and
    where that figure comes from; None where /proc does not tell the host's size."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            total = next(int(line.split()[1]) // 1024 for line in meminfo if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    side_by_side = max(1, int((os.cpu_count() or 1) // max(cpus, 1e-9)))
    if max_concurrent is not None:
        side_by_side = min(side_by_side, max_concurrent)
    budget = int(total * HOST_MEMORY_FOR_TRIALS / side_by_side)
    return budget, (f"{HOST_MEMORY_FOR_TRIALS:.0%} of this machine's {total} MiB shared by {side_by_side} "
                    f"trial{'s' if side_by_side > 1 else ''} at a time")
