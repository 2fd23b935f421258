"""What the host CPU computes with, as the plan's stacking estimate reads it (pure rules)."""

from pipeline.base import host_cpu

AVX512 = frozenset({"sse4_2", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"})


def test_the_graph_kernels_compute_with_avx512_only_where_onednn_may(monkeypatch):
    monkeypatch.setattr(host_cpu.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(host_cpu, "cpu_flags", lambda: AVX512)
    assert host_cpu.graph_vectors({}) == "avx512"
    assert host_cpu.graph_vectors({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}) == "avx512"
    assert host_cpu.graph_vectors({"ONEDNN_MAX_CPU_ISA": "all"}) == "avx512"
    # oneDNN held to AVX2, under either name, or off: TensorFlow's own (AVX) kernels
    assert host_cpu.graph_vectors({"ONEDNN_MAX_CPU_ISA": "AVX2"}) == "narrower"
    assert host_cpu.graph_vectors({"DNNL_MAX_CPU_ISA": "avx2_vnni"}) == "narrower"
    assert host_cpu.graph_vectors({"TF_ENABLE_ONEDNN_OPTS": "0"}) == "narrower"
    # AVX-512 without its byte and word instructions (the first Xeon Phi) is not oneDNN's avx512_core
    monkeypatch.setattr(host_cpu, "cpu_flags", lambda: AVX512 - {"avx512bw"})
    assert host_cpu.graph_vectors({}) == "narrower"
    monkeypatch.setattr(host_cpu, "cpu_flags", lambda: AVX512)
    monkeypatch.setattr(host_cpu.platform, "machine", lambda: "aarch64")
    assert host_cpu.graph_vectors({}) == "narrower"


def test_the_flags_are_read_from_cpuinfo_where_linux_has_it():
    flags = host_cpu.cpu_flags()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        line = ""
    assert flags == frozenset(line.partition(":")[2].split())
