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
from typing import NamedTuple

from pipeline.base.errors import FoldsweepError
from pipeline.contract.plan import ThreadPlan

# The GPU share this process's devices were set up for, and what was done.
_device_notice: tuple[float, str] | None = None


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
            "trial in a fresh process"
        ) from None


def threads_in_effect() -> ThreadPlan:
    """The thread pools TensorFlow runs with in this process (0: TensorFlow's default)."""
    import tensorflow as tf

    return ThreadPlan(
        intra_op=tf.config.threading.get_intra_op_parallelism_threads(),
        inter_op=tf.config.threading.get_inter_op_parallelism_threads(),
    )


def tf32_in_effect(device: str) -> bool:
    """Whether TensorFlow may round a GPU's matrix products and convolutions to TF32 in this
    process (its default, effective on Ampere and newer; ``NVIDIA_TF32_OVERRIDE=0`` or
    ``tf.config.experimental.enable_tensor_float_32_execution(False)`` turn it off). False on CPU."""
    import tensorflow as tf

    if "GPU" not in device or os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        return False
    return bool(tf.config.experimental.tensor_float_32_execution_enabled())


class DeviceError(FoldsweepError):
    """TensorFlow's devices cannot be set up as a trial needs (they started earlier in this process)."""


# Per process on a shared GPU, what lies outside TensorFlow's allocator and so outside its memory
# limit: the CUDA context and the code of cuBLAS and cuDNN that it loads (a few hundred MiB each
# on current drivers, more on a GPU with more multiprocessors). A fractional slot's limit leaves
# it free, so that n slots of 1/n fit on the card together with their n contexts.
GPU_CONTEXT_RESERVE_MB = 600


class GpuMemory(NamedTuple):
    total_mb: int
    free_mb: int | None  # None where nvidia-smi does not tell it


def configure_devices(gpu_fraction: float) -> str:
    """Set this process's GPUs for trials of ``gpu_fraction`` GPUs each, before TensorFlow
    initialises its devices, and return a one-line notice of what was done.

    - 0: no GPU is visible to TensorFlow (``hide_gpus``): Ray 2.60 no longer hides GPUs from a
      worker that asked for none (ray#54868), and TensorFlow would train on the first it sees.
    - a fraction below 1: a memory ceiling (``fractional_memory_limit_mb``) with memory growth,
      so that the slots packed onto one GPU grow into their shares instead of each reserving its
      share at start-up; growth alone where the GPU's size is unknown.
    - 1: memory growth: the whole GPU, taken as the trial needs it.

    Raises:
        DeviceError: TensorFlow has already set up its devices here otherwise (a trial in this
            process would hold more of the GPU than its slot, or a GPU it did not reserve).
    """
    global _device_notice
    if _device_notice is not None and _device_notice[0] == gpu_fraction:
        return _device_notice[1]
    import tensorflow as tf

    if gpu_fraction == 0:
        notice = (
            "resources.gpu is 0: this worker's TensorFlow sees no GPU, training on CPU"
            if hide_gpus()
            else "no GPU visible to this worker: training on CPU"
        )
        _device_notice = (gpu_fraction, notice)
        return notice
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        _device_notice = (gpu_fraction, "no GPU visible to this worker: training on CPU")
        return _device_notice[1]
    memory = _gpu_memory() if gpu_fraction < 1 else None
    limit = None if memory is None else fractional_memory_limit_mb(gpu_fraction, memory)
    # TensorFlow's Python API refuses memory growth on a device with a memory limit (context.py
    # set_memory_growth: "Cannot set memory growth on device when virtual devices configured")
    # and drops allow_growth from its GPUOptions once a limit is set; its GPU allocator reads
    # TF_FORCE_GPU_ALLOW_GROWTH when it is created and takes it over the options, so the limit
    # (the allocator's size) and growth (allocate only what is used) combine through it.
    os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
    try:
        for gpu in gpus:
            if limit is not None:
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit)]
                )
            else:
                tf.config.experimental.set_memory_growth(gpu, True)
    except RuntimeError as exc:
        raise DeviceError(
            f"resources.gpu {gpu_fraction:g}: TensorFlow has already set up the GPUs of this process, so it can no "
            f"longer be limited to its slot ({exc}); run the trial in a fresh process"
        ) from None
    if memory is not None:  # the limit set above is this GPU memory's share
        free = f", {memory.free_mb} MiB free" if memory.free_mb is not None else ""
        notice = (
            f"GPU slot {gpu_fraction:g} of {memory.total_mb} MiB{free}: memory grows up to {limit} MiB "
            f"({GPU_CONTEXT_RESERVE_MB} MiB left for the CUDA context)"
        )
    elif gpu_fraction < 1:
        notice = (
            f"GPU slot {gpu_fraction:g} of a GPU of unknown size (nvidia-smi did not answer): memory growth, no ceiling"
        )
    else:
        notice = "GPU with memory growth"
    _device_notice = (gpu_fraction, notice)
    return notice


def fractional_memory_limit_mb(gpu_fraction: float, memory: GpuMemory) -> int:
    """The most a slot of ``gpu_fraction`` of a GPU may allocate, in MiB: its share of the
    card, or what is free when less (another process holds part of it), less the reserve for
    its CUDA context."""
    share = int(gpu_fraction * memory.total_mb)
    if memory.free_mb is not None:
        share = min(share, memory.free_mb)
    return max(share - GPU_CONTEXT_RESERVE_MB, 1)


def hide_gpus() -> bool:
    """Keep every GPU from this process's TensorFlow, before it initialises its devices: it then
    creates no CUDA context and takes no memory on any. Returns whether there were GPUs to hide.

    CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when TensorFlow first lists its devices: the
    variable is empty for that moment only, so that the processes this one starts (a local Ray
    and its workers) still see the machine's GPUs. ``set_visible_devices`` keeps TensorFlow off
    any GPU that CUDA found all the same (CUDA started earlier in the process).

    Raises:
        DeviceError: TensorFlow already runs on a GPU in this process.
    """
    import tensorflow as tf

    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        gpus = tf.config.list_physical_devices("GPU")
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError as exc:
        raise DeviceError(
            f"TensorFlow already runs on a GPU in this process ({exc}); resources.gpu 0 and the "
            "sweep's driver keep TensorFlow off the GPUs: run it in a fresh process"
        ) from None
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    return bool(gpus)


def _gpu_memory() -> GpuMemory | None:
    """Total and free memory of the first visible GPU, from nvidia-smi (which Ray's device mask
    respects); None where it does not answer."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    command = ["nvidia-smi", "--query-gpu=memory.total,memory.free", "--format=csv,noheader,nounits"]
    if visible:
        command += ["-i", visible]
    try:
        output = subprocess.run(command, capture_output=True, text=True, timeout=10, check=True).stdout
        total, _, free = output.strip().splitlines()[0].partition(",")
        return GpuMemory(int(total), int(free) if free.strip() else None)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


# Of the host's memory, what trials may count on: Ray's object store and the driver take the rest.
HOST_MEMORY_FOR_TRIALS = 0.5


def memory_per_trial_mb(*, cpus: float, gpus: float, max_concurrent: int | None) -> tuple[int, str] | None:
    """The memory one trial can hold, in MiB, and where that figure comes from: its share of
    the GPU when it runs on one whose size is known, else its share of the host's memory among
    the trials that run side by side. None when neither is known."""
    if gpus > 0:
        memory = _gpu_memory()
        if memory is None:
            return None
        if gpus >= 1:
            return memory.total_mb, f"a {memory.total_mb} MiB GPU"
        return (
            fractional_memory_limit_mb(gpus, GpuMemory(memory.total_mb, None)),
            f"{gpus:g} of a {memory.total_mb} MiB GPU less {GPU_CONTEXT_RESERVE_MB} MiB for its CUDA context",
        )
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
    return budget, (
        f"{HOST_MEMORY_FOR_TRIALS:.0%} of this machine's {total} MiB shared by {side_by_side} "
        f"trial{'s' if side_by_side > 1 else ''} at a time"
    )
