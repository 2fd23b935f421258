"""What the host CPU computes with: its feature flags, and the vector width of the kernels
TensorFlow's graph convolves and multiplies with on it (oneDNN's), read without loading TensorFlow.

oneDNN picks the widest instruction set the CPU has, up to ``ONEDNN_MAX_CPU_ISA``; TensorFlow calls
it on x86 Linux unless ``TF_ENABLE_ONEDNN_OPTS`` turns it off, and its own kernels are built for
AVX. An XLA program's kernels do not widen with the CPU the way oneDNN's do, so what a compiled
form saves against the graph depends on it (``pipeline.contract.compile_cost``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Mapping
from typing import Literal

# The vector width the graph's convolutions and matrix products compute with: AVX-512's, or
# narrower (AVX2, AVX, or no oneDNN).
GraphVectorWidth = Literal["avx512", "narrower"]
# The flags oneDNN's AVX-512 kernels for float32 need (its avx512_core).
AVX512_CORE_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
# oneDNN's cap on the instruction set, under its current name and the one before; and the caps
# that leave AVX-512 allowed (AVX10.1/512 contains it).
ONEDNN_MAX_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
AVX512_CAPS = ("AVX512", "AVX10_1_512")
ONEDNN_OFF_VARIABLE = "TF_ENABLE_ONEDNN_OPTS"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags (Linux's ``/proc/cpuinfo``); empty where they cannot be read."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    return frozenset()


def graph_vector_width(environ: Mapping[str, str] = os.environ) -> GraphVectorWidth:
    """The vector width TensorFlow's graph kernels compute with in a process of this environment:
    oneDNN's AVX-512 kernels where the CPU has them, TensorFlow calls oneDNN (its own rule for
    ``TF_ENABLE_ONEDNN_OPTS``: 0 or false turn it off) and oneDNN's cap, read as oneDNN reads it
    (``ONEDNN_MAX_CPU_ISA`` before ``DNNL_MAX_CPU_ISA``), allows them."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "narrower"
    if environ.get(ONEDNN_OFF_VARIABLE, "").strip().lower() in ("0", "false"):
        return "narrower"
    capped = next((environ[name] for name in ONEDNN_MAX_ISA_VARIABLES if environ.get(name)), "").strip().upper()
    if capped and capped not in ("ALL", "DEFAULT") and not capped.startswith(AVX512_CAPS):
        return "narrower"
    return "avx512" if AVX512_CORE_FLAGS <= cpu_flags() else "narrower"
