"""The persistent XLA compile cache: entries checked before TensorFlow reads them, a bounded
store, and a second identical trial in a fresh process that loads what the first compiled."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from helpers import REPO, Replace, foldsweep, latest_sweep

from pipeline.base import compile_cache
from pipeline.base.compile_cache import CHECKSUM_SUFFIX, CompileCache, content_name, content_names
from pipeline.contract.results import COMPILE_CACHE_HITS, COMPILE_CACHE_MISSES
from pipeline.records.tracking import Tag


def _message(fields: list[tuple[int, bytes | int]]) -> bytes:
    def varint(value: int) -> bytes:
        out = bytearray()
        while True:
            low, value = value & 0x7F, value >> 7
            out.append(low | (0x80 if value else 0))
            if not value:
                return bytes(out)

    encoded = b""
    for number, value in fields:
        if isinstance(value, int):
            encoded += varint(number << 3) + varint(value)
        else:
            encoded += varint(number << 3 | 2) + varint(len(value)) + value
    return encoded


def _entry(directory: Path, signature: int = 11, cluster: int = 22, executable: bytes = b"\x01" * 64) -> Path:
    key = _message([(1, signature), (2, cluster), (3, b"XLA_CPU_JIT")])
    path = directory / f"xla_compile_cache__{signature}__{cluster}__XLA_CPU_JIT.pb"
    path.write_bytes(_message([(1, key), (2, b"hlo"), (3, executable)]))
    return path


def _process_cache(tmp_path: Path) -> CompileCache:
    store, own = tmp_path / "store", tmp_path / "store" / ".processes" / "1-ab"
    own.mkdir(parents=True)
    return CompileCache(store, own)


def test_an_entry_enters_the_store_complete_and_other_processes_link_it(tmp_path):
    writer, reader = (
        _process_cache(tmp_path),
        CompileCache(tmp_path / "store", tmp_path / "store" / ".processes" / "2-cd"),
    )
    reader.process_directory.mkdir(parents=True)
    entry = _entry(writer.process_directory)
    half = writer.process_directory / "xla_compile_cache__33__44__XLA_CPU_JIT.pb"
    half.write_bytes(entry.read_bytes()[:-10])  # a write still under way, or cut short

    assert writer.publish() == 1
    reader.refresh()

    assert sorted(p.name for p in writer.store.glob("*.pb")) == [entry.name]
    assert (writer.store / (entry.name + CHECKSUM_SUFFIX)).exists()
    assert (reader.process_directory / entry.name).read_bytes() == entry.read_bytes()


@pytest.mark.parametrize("damage", ["truncated", "flipped", "foreign", "no checksum"])
def test_a_damaged_or_foreign_store_entry_is_removed_not_given_to_tensorflow(tmp_path, damage):
    cache = _process_cache(tmp_path)
    entry = cache.store / _entry(cache.process_directory).name
    cache.publish()
    if damage == "truncated":
        entry.unlink()
        entry.write_bytes(_entry(tmp_path).read_bytes()[:-5])
    elif damage == "flipped":  # still a well-formed message, not the bytes that were published
        entry.unlink()
        entry.write_bytes(_entry(tmp_path, executable=b"\x02" * 64).read_bytes())
    elif damage == "foreign":  # another program's entry under this name
        entry.unlink()
        entry.write_bytes(_entry(tmp_path, signature=99).read_bytes())
    else:
        (cache.store / (entry.name + CHECKSUM_SUFFIX)).unlink()
    reader = CompileCache(cache.store, cache.store / ".processes" / "3-ef")
    reader.process_directory.mkdir(parents=True)

    reader.refresh()

    assert reader.discarded == [entry.name]
    assert not entry.exists() and not list(reader.process_directory.glob("*.pb"))


def test_the_store_keeps_the_most_recently_used_entries_within_its_bound(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    entries = [_entry(store, signature=i, executable=b"\x01" * 1000) for i in range(1, 5)]
    for age, entry in enumerate(entries):  # the first is the least recently used
        os.utime(entry, (1_000_000 + age, 1_000_000 + age))
    size = entries[0].stat().st_size

    removed = compile_cache.prune(store, limit_bytes=2 * size)

    assert removed == [entries[0].name, entries[1].name]
    assert sorted(p.name for p in store.glob("*.pb")) == sorted([entries[2].name, entries[3].name])


def _traced(rate: float, *, keep: list) -> tuple[str, str]:
    """The name of a traced jit step with a cond whose branches bake in ``rate``, and of its true branch."""
    import tensorflow as tf

    with content_names():
        step = tf.function(
            lambda x: tf.cond(tf.reduce_sum(x) > 0, lambda: x * rate, lambda: x - rate), jit_compile=True
        )
        concrete = step.get_concrete_function(tf.TensorSpec([4], tf.float32))
    keep.append((step, concrete))
    assert float(concrete(tf.ones([4]))[0]) == rate  # compiled and run under its own name
    [cond] = [op for op in concrete.graph.get_operations() if op.type in ("If", "StatelessIf")]
    return concrete.name.decode(), cond.get_attr("then_branch").name


def test_traced_functions_are_named_after_their_graphs_nested_functions_included():
    live: list = []
    first, first_branch = _traced(0.5, keep=live)
    for name, prefix in ((first, "__inference_"), (first_branch, "cond_true_")):
        assert name.startswith(prefix) and int(name.rpartition("_")[2]) >= compile_cache.CONTENT_NAME_FLOOR
    # The same program traced again while the first is alive: the same names, and both run.
    assert _traced(0.5, keep=live) == (first, first_branch)
    # Another constant baked into a branch: other names all the way up, so TensorFlow's
    # in-memory cache (keyed by name) cannot hand one trial's program to the other.
    other, other_branch = _traced(0.25, keep=live)
    assert other != first and other_branch != first_branch
    assert content_name("no_counter_in_it", graph=None) == "no_counter_in_it"  # left as it is, graph unread


def test_one_graph_compiled_by_xla_and_not_is_two_functions_with_two_names():
    """TensorFlow refuses a second definition under a name, and a function's attributes (XLA's
    mark) are part of its definition: a launch is traced unmarked (``compile_call``) and a
    trial without XLA traces the same graph marked not to compile."""
    import tensorflow as tf

    names = []
    with content_names():
        for jit_compile in (None, False, True):
            function = tf.function(lambda x: x * 0.5, jit_compile=jit_compile, autograph=False)
            concrete = function.get_concrete_function(tf.TensorSpec([2], tf.float32))
            assert [float(value) for value in concrete(tf.ones([2]))] == [0.5, 0.5]
            names.append(concrete.name)
    assert len(set(names)) == 3


def test_a_custom_gradient_traced_again_shares_the_name_and_both_still_differentiate_their_own():
    """TensorFlow registers each custom gradient under a new process-wide name, written into the
    graph; the digest leaves those names out, so a later trace of the same step (Keras' optimizer
    step has one) gets the same name while the first is alive, and both run as they should."""
    import tensorflow as tf

    def traced(rate: float) -> tuple[str, Any]:
        @tf.custom_gradient
        def tripled_gradient(x):
            return tf.identity(x), lambda upstream: upstream * 3.0

        def step(x):
            # Not differentiated, like Keras' optimizer step: the branch keeps its first definition.
            forward = tf.cond(tf.reduce_sum(x) > 0, lambda: tripled_gradient(x) * rate, lambda: x)
            with tf.GradientTape() as tape:
                tape.watch(x)
                total = tf.reduce_sum(tf.cond(tf.reduce_sum(x) > 0, lambda: tripled_gradient(x) * rate, lambda: x))
            return forward, tape.gradient(total, x)

        with content_names():
            concrete = tf.function(step, jit_compile=True).get_concrete_function(tf.TensorSpec([2], tf.float32))
        return concrete.name.decode(), concrete

    first_name, first = traced(0.5)
    second_name, second = traced(0.5)
    assert second_name == first_name
    for concrete in (first, second):
        forward, gradient = concrete(tf.ones([2]))
        assert [float(v) for v in forward] == [0.5, 0.5] and [float(v) for v in gradient] == [1.5, 1.5]
    assert traced(0.25)[0] != first_name


def test_a_marked_call_is_compiled_by_xla_and_counted_as_the_program_it_is():
    import tensorflow as tf

    table = tf.constant([1.0, 2.0])
    lookup = tf.function(lambda index: tf.gather(table, index), autograph=False)

    def marked(index):
        value = lookup(index)
        compile_cache.compile_call(value.op)
        return value

    before = compile_cache.traced_programs()
    # Out of range: TensorFlow's own kernel refuses the index, and XLA clamps it to the last one.
    assert float(tf.function(marked, autograph=False)(tf.constant(5))) == 2.0
    assert compile_cache.programs_since(before) == 1
    with pytest.raises(tf.errors.InvalidArgumentError):
        lookup(tf.constant(5))


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(compile_cache.DISABLE_VARIABLE, "off")
    assert compile_cache.disabled_by_environment()
    monkeypatch.setenv(compile_cache.DISABLE_VARIABLE, "1")
    assert not compile_cache.disabled_by_environment()


def xla_quickstart(directory: Path) -> str:
    """The quickstart's spec with XLA forced: a trial this short would otherwise run without it
    (its compile weighed against its few steps), and the cache holds XLA's programs."""
    import yaml

    spec = yaml.safe_load((REPO / "sweeps" / "quickstart.yaml").read_text())
    spec["experiment"] = f"{REPO / 'experiments' / 'mnist1d_cnn.py'}:build"
    spec["train"]["jit_compile"] = True
    path = directory / "quickstart.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


TRIAL_OPTIONS = (
    "--epochs",
    "2",
    "--fold",
    "0",
    "--set",
    "dropout=0.0",
    "--set",
    "learning_rate=0.003",
    "--set",
    "batch_size=48",
    "--set",
    "conv_layers=1",
)


def _losses(output: str) -> list[str]:
    return re.findall(r"(?:train_loss|val_loss|val_accuracy) (\S+)", output)


@pytest.mark.e2e
def test_a_second_identical_trial_loads_its_programs_and_trains_bit_identically(tmp_path, monkeypatch):
    """Three `foldsweep trial` processes (30 s): the cache is per process, so a process is what it tests."""
    monkeypatch.setenv(compile_cache.DIRECTORY_VARIABLE, str(tmp_path / "xla"))
    trial = ("trial", xla_quickstart(tmp_path), *TRIAL_OPTIONS)
    first = foldsweep(*trial, cwd=REPO)
    assert first.exit_code == 0, first.output
    stores = list((tmp_path / "xla").glob("tf*"))
    assert len(stores) == 1
    store = stores[0]
    entries = {p.name: p.stat().st_mtime_ns for p in store.glob("*.pb")}
    assert entries, "the first trial compiled and published its programs"
    # A damaged entry is removed and its program compiled again, never a crash.
    damaged = sorted(entries)[0]
    (store / damaged).write_bytes((store / damaged).read_bytes()[:-100])

    second = foldsweep(*trial, cwd=REPO)

    assert second.exit_code == 0, second.output
    assert _losses(second.output) == _losses(first.output) and _losses(first.output)
    after = {p.name: p.stat().st_mtime_ns for p in store.glob("*.pb")}
    assert set(after) == set(entries)  # no new program: every other one was loaded from the store
    assert after[damaged] != entries[damaged]  # the damaged one was compiled and published again
    assert all(after[name] == entries[name] for name in entries if name != damaged)
    assert not list((store / ".processes").iterdir())

    monkeypatch.setenv(compile_cache.DISABLE_VARIABLE, "off")
    without = foldsweep(*trial, cwd=REPO)
    assert without.exit_code == 0, without.output
    assert _losses(without.output) == _losses(first.output)


def test_a_process_whose_tensorflow_read_its_flags_runs_without_the_cache(monkeypatch, tmp_path):
    import tensorflow as tf

    tf.config.list_physical_devices("CPU")  # TensorFlow has read its XLA flags from here on
    monkeypatch.setattr(compile_cache, "_active", None)
    monkeypatch.setenv(compile_cache.DIRECTORY_VARIABLE, str(tmp_path))
    monkeypatch.setenv("TF_XLA_FLAGS", f"--tf_xla_auto_jit=0 {compile_cache.TF_CACHE_FLAG}=/parent/own")

    assert compile_cache.activate(device_kind="cpu:test") is None
    assert os.environ["TF_XLA_FLAGS"] == "--tf_xla_auto_jit=0"  # the parent's directory is not this one's
    assert not list(tmp_path.iterdir())


def test_another_tensorflow_version_xla_flags_or_device_kind_gets_another_store(monkeypatch):
    import tensorflow as tf

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("TF_XLA_FLAGS", f"{compile_cache.TF_CACHE_FLAG}=/a")
    here = compile_cache.store_name("cpu:x86_64:abc")
    monkeypatch.setenv("TF_XLA_FLAGS", f"{compile_cache.TF_CACHE_FLAG}=/b")
    assert compile_cache.store_name("cpu:x86_64:abc") == here  # the process's own directory is not an XLA setting
    others = {compile_cache.store_name("cpu:x86_64:def"), compile_cache.store_name("gpu:NVIDIA A100, 8.0")}
    monkeypatch.setenv("TF_XLA_FLAGS", "--tf_xla_auto_jit=2")
    others.add(compile_cache.store_name("cpu:x86_64:abc"))
    monkeypatch.delenv("TF_XLA_FLAGS")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    others.add(compile_cache.store_name("cpu:x86_64:abc"))
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(tf, "__version__", "2.99.0")
    others.add(compile_cache.store_name("cpu:x86_64:abc"))
    assert len(others) == 5 and here not in others
    assert compile_cache.store_name("cpu:x86_64:abc").startswith("tf2.99.0-")


def test_a_dead_process_directory_of_this_machine_is_published_and_removed(tmp_path):
    import platform

    store = tmp_path / "store"
    dead = store / compile_cache.PROCESS_DIRECTORIES / f"999999999-aa@{platform.node()}"
    elsewhere = store / compile_cache.PROCESS_DIRECTORIES / "999999999-bb@another-machine"
    for directory in (dead, elsewhere):
        directory.mkdir(parents=True)
    entry = _entry(dead)
    _entry(elsewhere, signature=5)

    compile_cache._adopt_orphans(store)

    assert not dead.exists() and elsewhere.exists()
    assert [p.name for p in store.glob("*.pb")] == [entry.name]


@pytest.mark.e2e
def test_a_worker_reuses_the_programs_of_its_earlier_trials_and_never_another_programs(
    ray_cluster, tmp_path, write_spec, empty_store, monkeypatch
):
    """Four trials in one worker process: the learning rate is a variable, so a trial with another
    one loads the programs its predecessor compiled; the clip threshold is baked into the program,
    so another threshold compiles its own (had it run the other's, it would train identically)."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    monkeypatch.chdir(tmp_path)
    spec = write_spec(
        {
            "name": "reuse",
            "dataset": {"num_samples": 360},
            "search": {
                "num_samples": 1,
                "space": {
                    "learning_rate": {"grid": [0.01, 0.02]},
                    "clipping": "norm",
                    "clip_threshold": {"grid": [1.0, 0.0371]},
                    "batch_size": 24,
                    "conv_layers": 1,
                    "filters": 8,
                    "kernel_size": 3,
                    "dropout": 0.0,
                },
            },
            "train": {"epochs": 1, "jit_compile": True},
            "resources": {"max_concurrent": 1},
        }
    )

    result = CliRunner().invoke(app, ["run", str(spec)])

    assert result.exit_code == 0, result.output
    _, _, trials = latest_sweep(f"sqlite:///{tmp_path / 'mlflow.db'}", "reuse")
    started = sorted(trials, key=lambda run: run.started_at)
    assert len(trials) == 4 and len({run.tags[Tag.of("pid")] for run in trials}) == 1
    assert all(later.started_at >= earlier.ended_at for earlier, later in zip(started, started[1:]))
    by_config = {
        (float(run.params["learning_rate"]), float(run.params["clip_threshold"])): run.metrics for run in trials
    }
    first_of_threshold: dict[float, tuple[float, float]] = {}
    for run in started:
        config = (float(run.params["learning_rate"]), float(run.params["clip_threshold"]))
        metrics = run.metrics
        if config[1] in first_of_threshold:
            assert metrics[COMPILE_CACHE_MISSES] == 0 and metrics[COMPILE_CACHE_HITS] > 0, config
        else:
            first_of_threshold[config[1]] = config
            assert metrics[COMPILE_CACHE_MISSES] > 0, config
    for learning_rate in (0.01, 0.02):
        assert (
            by_config[(learning_rate, 1.0)]["split0_val_loss"] != by_config[(learning_rate, 0.0371)]["split0_val_loss"]
        )


@pytest.mark.e2e
def test_the_refit_in_the_driver_compiles_into_the_store_too(tmp_path, write_spec, empty_store, monkeypatch):
    """`foldsweep run` in a fresh process (the driver's TensorFlow must not have started): every
    entry beyond the ones the trial compiled is the refit's."""
    monkeypatch.setenv(compile_cache.DIRECTORY_VARIABLE, str(tmp_path / "xla"))
    spec = write_spec(
        {
            "name": "refit-cache",
            "search": {
                "num_samples": 1,
                "space": Replace(
                    {
                        "learning_rate": 0.01,
                        "batch_size": 32,
                        "conv_layers": 1,
                        "filters": 8,
                        "kernel_size": 3,
                        "dropout": 0.0,
                    }
                ),
            },
            "train": {"epochs": 1, "jit_compile": True, "refit": True},
        }
    )

    ran = foldsweep("run", str(spec), cwd=tmp_path)

    assert ran.exit_code == 0, ran.output
    _, parent, [trial] = latest_sweep(f"sqlite:///{tmp_path / 'mlflow.db'}", "refit-cache")
    assert "test_accuracy" in parent.metrics
    entries = list((tmp_path / "xla").glob(f"tf*/*{compile_cache.ENTRY_SUFFIX}"))
    assert trial.metrics[COMPILE_CACHE_MISSES] > 0
    assert len(entries) > trial.metrics[COMPILE_CACHE_MISSES]
