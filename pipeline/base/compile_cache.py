"""A persistent cache of compiled XLA programs, shared by every foldsweep process that compiles.

TensorFlow can keep the programs it compiles on disk and load them instead of compiling again
(``--tf_xla_persistent_cache_directory``). Used as it is, that cache rarely hits in a sweep and
can crash a trial, so foldsweep puts three things around it:

- **Entries are checked before TensorFlow sees them.** TensorFlow fails the op on an entry it
  cannot parse, and writes entries in place, so a process could read another's half-written
  file. Each process therefore compiles into a directory of its own, seeded with hard links to
  the shared store's entries that pass the check (complete, their key matching their file name,
  their checksum unchanged); new entries enter the store by an atomic link once complete.
- **One store per TensorFlow version, XLA flags, determinism setting and device kind** (a GPU's
  model, driver, CUDA and cuDNN), so that none of them ever reuses a stale entry; TensorFlow's own
  key adds the program's HLO, which it compares in full. A GPU that cannot be identified gets no
  cache (``UnknownGpu``): its programs would be filed under another device's key.
- **Names from content.** TensorFlow names every traced function after a process-wide counter,
  and the name is part of the cache key: two trials with the same program in one worker process
  got different keys. ``content_names`` names each traced function after its graph instead.

The store is bounded: past ``FOLDSWEEP_COMPILE_CACHE_MB`` the least recently used entries go.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.base import bounded_cache
from pipeline.base.accelerator import deterministic_ops, gpu_identity
from pipeline.base.environment import cache_directory
from pipeline.base.host_cpu import cpu_flags
from pipeline.base.tensorflow_private import (
    devices_set_up,
    gradient_names_numbered,
    mark_for_xla,
    marked_for_xla,
    traced_functions_named,
)

DISABLE_VARIABLE = "FOLDSWEEP_COMPILE_CACHE"  # off / 0 / false: no persistent cache
DIRECTORY_VARIABLE = "FOLDSWEEP_COMPILE_CACHE_DIR"
SIZE_VARIABLE = "FOLDSWEEP_COMPILE_CACHE_MB"
DEFAULT_SIZE_MB = 4096
TF_CACHE_FLAG = "--tf_xla_persistent_cache_directory"
ENTRY_SUFFIX = ".pb"
CHECKSUM_SUFFIX = ".sha256"
PROCESS_DIRECTORIES = ".processes"
# Far above TensorFlow's own counter, so a content name never equals one TensorFlow hands out.
CONTENT_NAME_FLOOR = 10**18
CAPTURED_NAME = "captured"


def cache_root() -> Path:
    """Where the stores live: ``$FOLDSWEEP_COMPILE_CACHE_DIR``, else the user's cache directory."""
    configured = os.environ.get(DIRECTORY_VARIABLE)
    if configured:
        return Path(configured).expanduser()
    return cache_directory() / "xla"


def disabled_by_environment() -> bool:
    return os.environ.get(DISABLE_VARIABLE, "").strip().lower() in {"0", "off", "false", "no"}


def size_limit_bytes() -> int:
    try:
        return int(float(os.environ.get(SIZE_VARIABLE, DEFAULT_SIZE_MB)) * 2**20)
    except ValueError:
        return DEFAULT_SIZE_MB * 2**20


@dataclass
class CacheCounts:
    """Compiled programs a trial needed, and how many it had to compile (the rest came from the cache)."""

    programs: int = 0
    compiled: int = 0

    @property
    def hits(self) -> int:
        return max(0, self.programs - self.compiled)


class CompileCache:
    """This process's view of the shared store: its own directory that TensorFlow reads and writes."""

    def __init__(self, store: Path, process_directory: Path):
        self.store = store
        self.process_directory = process_directory
        self.discarded: list[str] = []

    def refresh(self) -> None:
        """Link the store's checked entries that this process does not have yet."""
        for entry in sorted(self.store.glob(f"*{ENTRY_SUFFIX}")):
            target = self.process_directory / entry.name
            if target.exists():
                continue
            if not _checked(entry):
                self.discarded.append(entry.name)
                _remove(entry)
                continue
            with contextlib.suppress(OSError):
                os.link(entry, target)

    def written(self) -> list[Path]:
        """Entries TensorFlow wrote in this process (not links to the store)."""
        return [path for path in self.process_directory.glob(f"*{ENTRY_SUFFIX}") if path.stat().st_nlink == 1]

    def publish(self) -> int:
        """Move this process's complete new entries into the store; returns how many went in."""
        published = 0
        for entry in self.written():
            if _publish(entry, self.store):
                published += 1
        return published

    def close(self) -> None:
        self.publish()
        shutil.rmtree(self.process_directory, ignore_errors=True)


_active: CompileCache | None = None
_lock = threading.Lock()


def activate(*, device_kind: str) -> CompileCache | None:
    """Point TensorFlow's persistent XLA cache at a directory of this process, seeded from the
    store for this TensorFlow, XLA flags and ``device_kind``; before the process compiles.

    Returns None when the cache is switched off by the environment. Idempotent.
    """
    global _active
    with _lock:
        if _active is not None:
            return _active
        if disabled_by_environment() or _tensorflow_flags_fixed():
            # A directory inherited from the parent process is its own, not this one's.
            _set_tensorflow_cache_flag(None)
            return None
        store = cache_root() / store_name(device_kind)
        store.mkdir(parents=True, exist_ok=True)
        _adopt_orphans(store)
        prune(store, size_limit_bytes())
        process_directory = store / PROCESS_DIRECTORIES / f"{os.getpid()}-{os.urandom(4).hex()}@{platform.node()}"
        process_directory.mkdir(parents=True)
        cache = CompileCache(store, process_directory)
        cache.refresh()
        _set_tensorflow_cache_flag(process_directory)
        import atexit

        atexit.register(cache.close)
        _active = cache
        return cache


def deactivate() -> None:
    """This process compiles without the cache (``train.compile_cache: false``)."""
    if _active is None and not _tensorflow_flags_fixed():
        _set_tensorflow_cache_flag(None)


def _set_tensorflow_cache_flag(directory: Path | None) -> None:
    flags = [flag for flag in os.environ.get("TF_XLA_FLAGS", "").split() if not flag.startswith(TF_CACHE_FLAG)]
    if directory is not None:
        flags.append(f"{TF_CACHE_FLAG}={directory}")
    if flags:
        os.environ["TF_XLA_FLAGS"] = " ".join(flags)
    else:
        os.environ.pop("TF_XLA_FLAGS", None)


def _tensorflow_flags_fixed() -> bool:
    """TensorFlow reads its XLA flags once, when it first lists or sets up its devices: after
    that, a cache directory given to it would be silently ignored."""
    import sys

    if "tensorflow" not in sys.modules:
        return False
    return devices_set_up()


def active() -> CompileCache | None:
    return _active


def store_name(device_kind: str) -> str:
    """The store's directory name: everything an entry's own key leaves out that makes it stale."""
    import tensorflow as tf

    flags = sorted(flag for flag in os.environ.get("TF_XLA_FLAGS", "").split() if not flag.startswith(TF_CACHE_FLAG))
    identity = json.dumps(
        {
            "tensorflow": tf.__version__,
            "tf_xla_flags": flags,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "device": device_kind,
            "deterministic_ops": deterministic_ops(),
        },
        sort_keys=True,
    )
    return f"tf{tf.__version__}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def device_kind(gpus: float) -> str:
    """What XLA compiles for: the GPUs in use with their driver, CUDA and cuDNN (read without
    starting TensorFlow's devices, which would fix its flags), else, where the process may use no
    GPU, the host CPU's architecture and features.

    Raises:
        UnknownGpu: the process may use a GPU that cannot be identified (``nvidia-smi`` missing
            or failing where GPUs are present): no CPU's identity stands in for it.
    """
    if gpus > 0:
        identity = gpu_identity()
        if identity is not None:
            return "gpu:" + identity.describe()
    # The store's key hashes every token of cpuinfo's flags line, its name and colon included.
    flags = cpu_flags()
    features = " ".join(sorted(["flags", ":", *flags])) if flags else ""
    return f"cpu:{platform.machine()}:{hashlib.sha256(features.encode()).hexdigest()[:16]}"


def prune(store: Path, limit_bytes: int) -> list[str]:
    """Remove the least recently used entries (with their checksums) until the store fits in
    ``limit_bytes``."""
    return bounded_cache.prune(store, f"*{ENTRY_SUFFIX}", limit_bytes, remove=_remove)


def _adopt_orphans(store: Path) -> None:
    """Publish what processes of this machine that died (kill -9) compiled, and remove their
    directories (a store on a shared file system also holds other machines' live ones)."""
    for directory in (store / PROCESS_DIRECTORIES).glob(f"*-*@{platform.node()}"):
        pid = directory.name.split("-")[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        # Workers that start at once adopt the same orphans: another may remove it meanwhile.
        with contextlib.suppress(FileNotFoundError):
            for entry in directory.glob(f"*{ENTRY_SUFFIX}"):
                with contextlib.suppress(OSError):
                    if entry.stat().st_nlink == 1:
                        _publish(entry, store)
        shutil.rmtree(directory, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _publish(entry: Path, store: Path) -> bool:
    target = store / entry.name
    if target.exists() or not _complete(entry):
        return False
    checksum = _sha256(entry)
    staged = store / f".{entry.name}.{os.getpid()}.tmp"
    staged.write_text(checksum, encoding="ascii")
    os.replace(staged, store / (entry.name + CHECKSUM_SUFFIX))
    try:
        os.link(entry, target)
    except FileExistsError:
        return False
    return True


def _checked(entry: Path) -> bool:
    """A store entry is used only if it is complete, its key matches its file name and its bytes
    are those it was published with."""
    checksum = entry.with_name(entry.name + CHECKSUM_SUFFIX)
    try:
        return _complete(entry) and checksum.read_text(encoding="ascii").strip() == _sha256(entry)
    except OSError:
        return False


def _remove(entry: Path) -> None:
    for path in (entry, entry.with_name(entry.name + CHECKSUM_SUFFIX)):
        with contextlib.suppress(OSError):
            path.unlink()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _complete(entry: Path) -> bool:
    """The file is a whole XlaSerializedCacheEntry whose key is the one its name spells.

    TensorFlow names an entry ``[prefix__]signature__cluster__device.pb`` after the key it holds
    (field 1: signature fingerprint 1, cluster fingerprint 2, device type 3), and stores the HLO
    (field 2) and the executable (field 3). Read with the protobuf wire format directly: the
    message's class is not part of TensorFlow's Python package.
    """
    try:
        data = entry.read_bytes()
        fields = dict(_fields(data))
        key = dict(_fields(fields[1]))
        *_, signature, cluster, device = entry.name[: -len(ENTRY_SUFFIX)].split("__")
        return (
            bool(fields.get(3))
            and 2 in fields
            and key.get(1) == int(signature)
            and key.get(2) == int(cluster)
            and key.get(3) == device.encode()
        )
    except (OSError, KeyError, ValueError, TypeError):
        return False


def _fields(data: bytes) -> Iterator[tuple[int, Any]]:
    """(field number, value) of a protobuf message: varints as int, length-delimited as bytes."""
    position = 0
    value: int | bytes
    while position < len(data):
        tag, position = _varint(data, position)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            value, position = _varint(data, position)
        elif wire_type == 2:
            length, position = _varint(data, position)
            if position + length > len(data):
                raise ValueError("truncated")
            value, position = data[position : position + length], position + length
        elif wire_type == 1:
            value, position = data[position : position + 8], position + 8
        elif wire_type == 5:
            value, position = data[position : position + 4], position + 4
        else:
            raise ValueError(f"wire type {wire_type}")
        if position > len(data):
            raise ValueError("truncated")
        yield number, value


def _varint(data: bytes, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if position >= len(data) or shift > 63:
            raise ValueError("bad varint")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7


@contextlib.contextmanager
def content_names() -> Iterator[None]:
    """While tracing: every function TensorFlow creates (a step, a loop body, a cond branch) is
    named after a digest of its graph, the names of the functions it calls included.

    TensorFlow numbers them from a process-wide counter instead, and the name is part of the
    cache key, so two trials with the same program never found each other's. Named by content,
    every trial whose program is the same, in this process or any other, finds it compiled; two
    whose programs differ (another dropout rate or clip threshold baked in) never share a name,
    which TensorFlow's in-memory cache, keyed by name and argument shapes, relies on. What a
    called function captured reaches its caller unnamed, and is named by appearance in it.
    """

    def renamed(name: Any, graph: Any, attrs: Mapping[str, Any]) -> Any:
        named = content_name(name, graph, attrs)
        if marked_for_xla(attrs):
            _traced_programs.append(named)
        return named

    # A function called inside another passes its captured variables and tensors to the caller,
    # which captures them unnamed: TensorFlow names each after a process-wide counter too, and the
    # caller's graph numbers them by appearance instead.
    with traced_functions_named(renamed, CAPTURED_NAME):
        yield


def traced_programs() -> int:
    """How many XLA programs this process has traced so far: a position for ``programs_since``."""
    return len(_traced_programs)


def programs_since(position: int) -> int:
    """The distinct XLA programs traced since ``position``: a program every fold traces (their
    models built under the same names) counts once, as it is compiled or loaded once."""
    return len(set(_traced_programs[position:]))


# The XLA programs traced, in order: content names while content_names() is on.
_traced_programs: list[Any] = []


def compile_call(call: Any) -> None:
    """Have XLA compile one call of a function (an operation of a graph being traced), as
    ``tf.function(jit_compile=True)`` has it compile the function; counted as a program traced.

    Before XLA lowers a function marked itself, TensorFlow inlines every function it calls,
    whatever they ask; a function whose call is marked keeps a callee marked ``_noinline`` as a
    call, which XLA lowers once however often it is called (``compiled_loop.compiled_launch``).
    """
    mark_for_xla(call)
    _traced_programs.append(call.get_attr("f").name)


def content_name(name: Any, graph: Any, attrs: Mapping[str, Any] | None = None) -> Any:
    """``<prefix>_<n>``, TensorFlow's counter in ``n``, with ``n`` a digest of the graph and the
    function's attributes instead (the same graph compiled by XLA or not is two definitions)."""
    text = name.decode() if isinstance(name, bytes) else str(name)
    stem, _, number = text.rpartition("_")
    if not stem or not number.isdigit():
        return name
    renamed = f"{stem}_{CONTENT_NAME_FLOOR + _graph_digest(graph, attrs or {})}"
    return renamed.encode() if isinstance(name, bytes) else renamed


def _graph_digest(graph: Any, attrs: Mapping[str, Any]) -> int:
    """A digest of the graph and ``attrs``, as a number, with the graph's custom gradients'
    registry names (``CustomGradient-<counter>``, new in every trace) numbered by appearance.

    Those names are not part of the program, and TensorFlow takes two definitions that differ
    only in them (attributes of nodes starting with ``_``) as one under the same name; two that
    differ in the function's own attributes it refuses under one name.
    """
    graph_def = gradient_names_numbered(graph)
    digest = hashlib.sha256(graph_def.SerializeToString(deterministic=True))
    digest.update(repr(sorted((key, str(value)) for key, value in attrs.items())).encode())
    return int(digest.hexdigest(), 16) % 10**18
