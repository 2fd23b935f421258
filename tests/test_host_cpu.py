"""What the host CPU computes with, as the plan's stacking estimate reads it (pure rules)."""

import io

import pytest

from pipeline.base import compile_cache, host_cpu

AVX512 = frozenset({"sse4_2", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"})


def test_the_graph_kernels_compute_with_avx512_only_where_onednn_may(monkeypatch):
    monkeypatch.setattr(host_cpu.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(host_cpu, "cpu_flags", lambda: AVX512)
    width = host_cpu.graph_vector_width
    assert width({}) == "avx512"
    assert width({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}) == "avx512"
    assert width({"ONEDNN_MAX_CPU_ISA": "avx10_1_512"}) == "avx512"
    assert width({"ONEDNN_MAX_CPU_ISA": "all"}) == "avx512"
    # oneDNN held to AVX2, under either name (its current one first), or off in TensorFlow
    assert width({"ONEDNN_MAX_CPU_ISA": "AVX2"}) == "narrower"
    assert width({"DNNL_MAX_CPU_ISA": "avx2_vnni"}) == "narrower"
    assert width({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "DNNL_MAX_CPU_ISA": "AVX2"}) == "avx512"
    assert width({"TF_ENABLE_ONEDNN_OPTS": "0"}) == width({"TF_ENABLE_ONEDNN_OPTS": "False"}) == "narrower"
    assert width({"TF_ENABLE_ONEDNN_OPTS": "1"}) == "avx512"
    # AVX-512 without its byte and word instructions (the first Xeon Phi) is not oneDNN's avx512_core
    monkeypatch.setattr(host_cpu, "cpu_flags", lambda: AVX512 - {"avx512bw"})
    assert width({}) == "narrower"
    monkeypatch.setattr(host_cpu, "cpu_flags", lambda: AVX512)
    monkeypatch.setattr(host_cpu.platform, "machine", lambda: "aarch64")
    assert width({}) == "narrower"


@pytest.mark.parametrize(
    "cpuinfo, store_key",
    [
        # A CPU's store key: the hash of its whole flags line (name and colon included), or of nothing.
        ("processor\t: 0\nflags\t\t: fpu vme avx2 avx512f\nbogomips\t: 4800\n", "12b38a580be2d8a4"),
        ("processor\t: 0\n", "e3b0c44298fc1c14"),
    ],
)
def test_the_cpu_flags_keep_the_compile_caches_store_keys(monkeypatch, cpuinfo, store_key):
    monkeypatch.setattr(host_cpu, "open", lambda *args, **kwargs: io.StringIO(cpuinfo), raising=False)
    monkeypatch.setattr(compile_cache.platform, "machine", lambda: "x86_64")
    host_cpu.cpu_flags.cache_clear()
    try:
        assert compile_cache.device_kind(0) == f"cpu:x86_64:{store_key}"
    finally:
        host_cpu.cpu_flags.cache_clear()
