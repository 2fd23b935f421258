"""Shared fixtures: tiny specs, tiny data and experiment files written into temp dirs."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

REPO = Path(__file__).resolve().parents[1]
MNIST1D_EXPERIMENT = REPO / "experiments" / "mnist1d_cnn.py"

TINY_SPEC: dict[str, Any] = {
    "name": "tiny",
    "experiment": f"{MNIST1D_EXPERIMENT}:build",
    "dataset": {"name": "mnist1d", "num_samples": 400},
    "cv": {"splitter": "stratified", "n_splits": 2, "seed": 0},
    "search": {
        "num_samples": 2,
        "seed": 0,
        "space": {"conv_layers": 1, "filters": 16, "kernel_size": {"choice": [3, 5]}},
    },
    # No refit: it trains again in the driver, and only the tests of the refit ask for it.
    "train": {"epochs": 2, "metric": "accuracy", "mode": "max", "seed": 0, "refit": False},
    # One trial at a time: the next trial reuses the worker process, where a second one at once
    # would start its own (Ray and TensorFlow: ~6 s of a core, on two cores that the other
    # pytest worker keeps busy). Tests of concurrency ask for it.
    "resources": {"cpu": 1, "max_concurrent": 1},
}


@dataclass(frozen=True)
class Ran:
    exit_code: int
    output: str  # standard output, then standard error


def foldsweep(*args: str, cwd: Path | str | None = None) -> Ran:
    """The command in a fresh process, as a researcher runs it: TensorFlow not yet started there,
    so a trial run in-process (`trial`, `rerun`) gets the thread pools it asks for."""
    ran = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"})
    return Ran(ran.returncode, ran.stdout + ran.stderr)


# Under pytest-xdist (`make test` runs two workers), tests are sent to the workers a module at a
# time, so that a module's fixtures are made once; the modules that read the session's recorded
# sweep go to one worker together, so that it is recorded once. The heaviest go first: a sweep or
# a fresh process costs seconds, a pure-logic test milliseconds, and a heavy module sent last
# would leave the other worker idle until it ends.
SECONDS_PER_TEST = {"e2e": 8.0, "training": 3.0}


def xdist_scope(nodeid: str) -> str:
    return _module_scope(nodeid.split("::", 1)[0])


@functools.cache
def _module_scope(module: str) -> str:
    return "the recorded sweep" if "recorded_sweep" in (REPO / module).read_text() else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ByScope(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    if config.getvalue("dist") != "loadscope":
        return None
    config.option.loadscopereorder = False  # the workers order them; xdist's order is by test count
    return ByScope(config, log)


def cores_per_worker() -> int | None:
    """The cores each pytest worker has to itself when the run shares the machine between
    several (pytest-xdist), None in a run of one process."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None


def trains_in_process(session: pytest.Session) -> bool:
    return any(item.get_closest_marker("training") for item in session.items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """TensorFlow must not start while the tests are collected: `_tensorflow_as_in_a_trial_worker`
    sets it up at the first test, as a trial worker does before its first trial."""
    if cores_per_worker() is None and not trains_in_process(session):
        return
    from pipeline.base.compile_cache import _tensorflow_flags_fixed

    if _tensorflow_flags_fixed():
        raise pytest.UsageError("TensorFlow started while the tests were collected (a tensor, variable or Keras "
                                "SeedGenerator made at import or in a parametrize list), so the suite cannot set "
                                "up its thread pools and compile cache: make it when the test runs")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    cost: dict[str, float] = {}
    for item in items:
        scope = xdist_scope(item.nodeid)
        cost[scope] = cost.get(scope, 0.0) + max((SECONDS_PER_TEST.get(mark.name, 0.05)
                                                  for mark in item.iter_markers()), default=0.05)
    # stable: a scope's tests keep their order
    items.sort(key=lambda item: (-cost[xdist_scope(item.nodeid)], xdist_scope(item.nodeid)))


@pytest.fixture(autouse=True, scope="session")
def _data_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Datasets generated by tests are cached in a temp dir, never in the repo's data/; compiled
    programs too, never in the user's ~/.cache. Under pytest-xdist both are the run's, shared by
    its workers (each is written for concurrent processes: a dataset renamed into place, a
    program published whole), so a program or dataset one worker made the other reads."""
    run_directory = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_directory = run_directory.parent  # pytest-N/popen-gwK -> pytest-N, this run's
    for variable, name in (("FOLDSWEEP_DATA_DIR", "data"), ("FOLDSWEEP_COMPILE_CACHE_DIR", "xla")):
        directory = run_directory / f"shared-{name}"
        directory.mkdir(exist_ok=True)
        os.environ[variable] = str(directory)


@pytest.fixture(autouse=True, scope="session")
def _tensorflow_as_in_a_trial_worker(request: pytest.FixtureRequest, _data_dir: None) -> None:
    """Before the first test starts TensorFlow, this process is set up as a trial worker is.

    - Beside other pytest workers, it trains on the thread pools `plan_threads` gives a trial of
      its share of the cores (on two cores and two workers, one intra-op and one inter-op thread:
      the pools of the suite's own one-CPU trials). TensorFlow's default, a thread per core in
      each pool, has its threads wait for the cores the other worker holds: over the in-process
      training modules, two processes at once used 0.76-0.94x the CPU on one-CPU pools (`python
      -m benchmarks.suite_pools`). A run of one process keeps the default, faster alone.
    - A run that trains in this process compiles through the run's compile cache, as a trial
      worker does, and the tests that build one trainer after another clear Keras' session
      between them (`between_trials`), as a worker does between its trials, so that an identical
      program is loaded, not compiled again (`test_fused` alone: 225 -> 127 CPU-s). TensorFlow
      reads the cache's flag when it first lists its devices, which sizing its pools does: the
      cache comes first.
    """
    cores = cores_per_worker()
    if trains_in_process(request.session):
        from pipeline.base.compile_cache import activate, device_kind

        activate(device_kind=device_kind(0))
    if cores is not None:
        from pipeline.contract.plan import ExecutionChoices, plan_threads
        from pipeline.engine.runtime import configure_threads

        configure_threads(plan_threads(ExecutionChoices(), cpus=cores, n_folds=2))


def between_trials() -> None:
    """Keras' session cleared as a trial worker clears it between its trials
    (`FoldTrainable.reset_config`), for a test that builds one trainer after another: the next
    trainer's layers get the names, and so its programs the cache keys, of the last one's, and an
    identical program loads from the compile cache (`_tensorflow_as_in_a_trial_worker`). Without
    the garbage collection: it frees memory, never changes a program."""
    import keras

    keras.backend.clear_session(free_memory=False)


class LocalRay:
    """The session's one local Ray: started on first use, and started again only when a test
    needs another shape (logical GPUs, more CPUs) or none at all. A start and a stop cost
    about 4 s; one per module added up to over a minute."""

    DEFAULT = {"num_cpus": 2}

    def __init__(self) -> None:
        self.shape: dict[str, int] | None = None

    def ensure(self, **shape: int) -> None:
        import ray

        from pipeline.sweep import start_local_ray

        shape = shape or self.DEFAULT
        if ray.is_initialized() and shape == self.shape:
            return
        self.stop()
        start_local_ray(**shape)  # as `foldsweep run` starts its own
        self.shape = shape

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        self.shape = None


@pytest.fixture(scope="session")
def local_ray() -> Iterator[LocalRay]:
    cluster = LocalRay()
    yield cluster
    cluster.stop()


@pytest.fixture
def threads_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """For `foldsweep trial` / `rerun` in the test's own process: TensorFlow fixes its thread pools
    once it has started in a process (the suite's other tests started it), so the command keeps
    them instead of sizing its own. Pool sizes change no number these tests compare; a rerun that
    must match its trial bit for bit runs in a fresh process (test_rerun_fidelity_e2e)."""
    monkeypatch.setattr("pipeline.engine.runner.configure_threads", lambda threads: None)


@pytest.fixture(scope="module")
def ray_cluster(local_ray: LocalRay) -> None:
    """The session's local Ray of 2 CPUs (a trial's own CPUs, and so its threads, come from its
    spec's resources.cpu, not from the cluster's size)."""
    local_ray.ensure()


@pytest.fixture
def without_ray(local_ray: LocalRay) -> None:
    """No Ray running, for a test that shows something is refused before Ray starts."""
    local_ray.stop()


# lr 50 without clipping diverges; with global-norm clipping at 0.1 it trains.
RECORDED_SPACE: dict[str, Any] = {
    "conv_layers": 1, "filters": 16, "kernel_size": 3, "dropout": 0.0, "optimizer": "sgd", "batch_size": 8,
    "learning_rate": {"grid": [0.01, 50.0]}, "clipping": {"grid": ["none", "global_norm"]}, "clip_threshold": 0.1,
}


@dataclass(frozen=True)
class RecordedSweep:
    directory: Path  # holds spec.yaml, data.npz and the store, mlflow.db
    uri: str
    exit_code: int
    output: str  # what `foldsweep run` printed

    def runs(self):
        """(client, parent run, trial runs), read afresh."""
        return sweep_runs(self.uri, "diverging")


@functools.cache
def _empty_store_template() -> bytes:
    import tempfile

    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory(prefix="foldsweep-store-") as directory:
        database = Path(directory) / "mlflow.db"
        MlflowClient(f"sqlite:///{database}").search_experiments()
        return database.read_bytes()


def seed_store(database: Path) -> Path:
    """An empty MLflow store at ``database``, copied from one this test process created once.
    A new store runs MLflow's schema migrations, 2-3 s of a busy core per sweep; the tests that
    seed record sweeps, not a store's birth (test_stores, test_newcomer_e2e and the fresh-store
    race in test_reliability_e2e start from no file)."""
    database.parent.mkdir(parents=True, exist_ok=True)
    database.write_bytes(_empty_store_template())
    return database


@pytest.fixture
def empty_store(tmp_path: Path) -> Path:
    """tmp_path/mlflow.db, the store of ``write_spec``'s specs, as an empty MLflow store (seed_store)."""
    return seed_store(tmp_path / "mlflow.db")


@pytest.fixture(scope="session")
def recorded_sweep(local_ray: LocalRay, tmp_path_factory: pytest.TempPathFactory) -> RecordedSweep:
    """The session's one recorded sweep, for every test that reads a record (its runs, cv_results,
    plots, report, UI) or reruns one of its trials: 4 trials (lr 0.01 / 50 x clipping none /
    global_norm), one of them NaN, refit included, on a data file (a rerun must notice when the
    data changes). Tests that rerun add runs tagged foldsweep.role=rerun; none changes the sweep's."""
    import numpy as np
    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.inputs.datasets import load_dataset
    from pipeline.inputs.spec import DatasetSpec

    directory = tmp_path_factory.mktemp("recorded")
    uri = f"sqlite:///{seed_store(directory / 'mlflow.db')}"
    source = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 400}))
    np.savez(directory / "data.npz", x=source.x, y=source.y, x_test=source.x_test, y_test=source.y_test)
    spec = merged(TINY_SPEC, {"name": "diverging", "dataset": str(directory / "data.npz"),
                              "search": {"num_samples": 1, "space": Replace(RECORDED_SPACE)},
                              "train": {"refit": True}, "tracking": {"uri": uri}})
    (directory / "spec.yaml").write_text(yaml.safe_dump(spec))
    local_ray.ensure()
    result = CliRunner().invoke(app, ["run", str(directory / "spec.yaml")])
    return RecordedSweep(directory, uri, result.exit_code, result.output)


def sweep_runs(uri: str, name: str):
    """(client, parent run, trial runs) of the latest sweep recorded under experiment ``name``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id])
    parent = next(run for run in runs if run.data.tags["foldsweep.role"] == "sweep")
    trials = [run for run in runs if run.data.tags["foldsweep.role"] == "trial"]
    return client, parent, trials


def run_learning_rate_grid(directory: Path, store: str, document: dict[str, Any]):
    """Run the sweep ``document`` (a grid over learning rates) from ``directory`` in this process;
    returns (its output, client, parent run, {learning rate: trial run})."""
    import yaml
    from typer.testing import CliRunner

    from pipeline.cli import app

    (directory / "spec.yaml").write_text(yaml.safe_dump({**document, "tracking": {"uri": store}}))
    result = CliRunner().invoke(app, ["run", str(directory / "spec.yaml")])
    assert result.exit_code == 0, result.output
    client, parent, trials = sweep_runs(store, document["name"])
    return result.output, client, parent, {float(run.data.params["learning_rate"]): run for run in trials}


def binary_data(n: int = 600, seed: int = 0) -> tuple[Any, Any]:
    """Two classes (0/1) told apart by the sign of a bump in a noisy 16-step signal."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n).astype(np.int32)
    x = rng.normal(size=(n, 16, 1)).astype(np.float32)
    x[:, 4:8, 0] += (2 * y - 1)[:, None] * 0.8
    return x, y


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``overrides`` into a copy of ``base``.

    A value of ``DELETE`` removes the key; ``Replace(value)`` sets it without merging.
    """
    result = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is DELETE:
            result.pop(key, None)
        elif isinstance(value, Replace):
            result[key] = value.value
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


DELETE = object()


class Replace:
    def __init__(self, value: Any):
        self.value = value


@pytest.fixture
def write_spec(tmp_path: Path) -> Callable[..., Path]:
    """Write the tiny spec, changed by overrides, with its tracking store inside tmp_path."""

    def write(overrides: dict[str, Any] | None = None, *, name: str = "spec.yaml") -> Path:
        spec = merged(TINY_SPEC, {"tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}})
        spec = merged(spec, overrides or {})
        path = tmp_path / name
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        return path

    return write


@pytest.fixture
def write_experiment(tmp_path: Path) -> Callable[[str, str], Path]:
    def write(source: str, name: str = "experiment.py") -> Path:
        path = tmp_path / name
        path.write_text(source)
        return path

    return write


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition: Callable[[], Any], *, seconds: float, what: str) -> Any:
    """Poll until ``condition()`` is truthy (waiting on other processes, not timing anything)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def answers(url: str) -> bytes | None:
    """The body at ``url``, or None while nothing listens there."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read() or b" "
    except OSError:
        return None


@contextlib.contextmanager
def serving(command: list[str], *, url: str, what: str, **popen: Any) -> Iterator[subprocess.Popen]:
    """A server started in its own session and answering at ``url``/health; on exit, stopped
    with every process it started."""
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True, **popen)
    try:
        def listening() -> bytes | None:
            assert server.poll() is None, f"{what} exited"
            return answers(f"{url}/health")

        wait_for(listening, seconds=120, what=what)
        yield server
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
