"""What tests share that is not a fixture: the tiny spec and its merging, the command in a fresh
process, seeded stores and sweeps read back through the package's own reader, tiny data, and
waiting on servers. Fixtures are conftest.py's; the run's machinery is run_machinery.py's."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

if TYPE_CHECKING:
    from pipeline.records.tracking import SweepRecord, Tracker, TrialRecord

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
    ran = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
    )
    return Ran(ran.returncode, ran.stdout + ran.stderr)


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


# -- records ------------------------------------------------------------------------------------


def seed_store(database: Path) -> Path:
    """An empty MLflow store at ``database``, as a new store starts: a copy of the one foldsweep
    keeps in its cache (``pipeline.records.stores.empty_store``), opened once by MLflow, which
    makes its default experiment. A store of MLflow's own migrations costs 2-3 s of a busy core
    per sweep; the tests that seed record sweeps, not a store's birth (test_stores,
    test_newcomer_e2e and the fresh-store race in test_reliability_e2e start from no file)."""
    # A raw client: the store's birth (MLflow's schema), not a record of foldsweep's.
    from mlflow.tracking import MlflowClient

    from pipeline.records.tracking import make_empty_store

    empty = make_empty_store()
    assert empty is not None, "no empty store could be made in foldsweep's cache"
    database.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(empty, database)
    MlflowClient(tracking_uri=f"sqlite:///{database}").search_experiments(max_results=1)
    return database


class Recorded(NamedTuple):
    """The sweeps recorded under one name, read through the package's reader."""

    tracker: Tracker
    sweeps: list[SweepRecord]  # newest first
    trials: list[TrialRecord]  # of every sweep, newest sweep first, each sweep's oldest trial first


class Latest(NamedTuple):
    """The latest sweep recorded under one name, read through the package's reader."""

    tracker: Tracker
    sweep: SweepRecord
    trials: list[TrialRecord]  # oldest first


def recorded_sweeps(uri: str, name: str) -> Recorded:
    """The sweeps recorded under ``name`` in the store ``uri`` and their trials; none while
    there is no such sweep."""
    from pipeline.records.tracking import Tracker

    tracker = Tracker(uri)
    sweeps = tracker.sweep_records(name)
    return Recorded(tracker, sweeps, [trial for sweep in sweeps for trial in tracker.trial_records(sweep.run_id)])


def latest_sweep(uri: str, name: str) -> Latest:
    """The latest sweep recorded under ``name`` in the store ``uri`` and its trials."""
    from pipeline.records.tracking import Tracker

    tracker = Tracker(uri)
    sweep = tracker.find_sweep(name)
    return Latest(tracker, sweep, tracker.trial_records(sweep.run_id))


def runs_in_store(uri: str, name: str) -> int:
    """How many runs the store holds under the experiment ``name``, whatever wrote them: a raw
    MLflow client, as the records show only the runs foldsweep knows."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return len(client.search_runs([client.get_experiment_by_name(name).experiment_id], max_results=50000))


def history(store: str, run_id: str, key: str) -> dict[int, float]:
    """A run's metric ``key`` as recorded, {epoch: value} in epoch order, read through the
    package's reader (``Tracker``)."""
    from pipeline.records.tracking import Tracker

    return dict(sorted(Tracker(store).metric_histories([run_id], key)[run_id]))


def curve(store: str, run_id: str, key: str) -> list[float]:
    """``history``'s values, in epoch order."""
    return list(history(store, run_id, key).values())


def assert_rerun_reproduces(
    store: str, directory: Path, original: TrialRecord, keys: list[str], *, epochs: int
) -> None:
    """`foldsweep rerun` of the trial ``original`` in a fresh process (its thread pools are the
    trial's, fixed once TensorFlow starts in a process) records each of ``keys`` over ``epochs``
    epochs as the trial did, to rel 1e-6."""
    from pipeline.records.tracking import Tracker

    ran = foldsweep("rerun", original.run_id, "--tracking-uri", store, cwd=directory)
    assert ran.exit_code == 0, ran.output
    again = Tracker(store).reruns(original.run_id)[0]
    for key in keys:
        recorded, rerun = curve(store, original.run_id, key), curve(store, again.run_id, key)
        assert len(recorded) == epochs and rerun == pytest.approx(recorded, rel=1e-6, abs=0), key


def run_learning_rate_grid(
    directory: Path, store: str, document: dict[str, Any]
) -> tuple[str, Tracker, SweepRecord, dict[float, TrialRecord]]:
    """Run the sweep ``document`` (a grid over learning rates) from ``directory`` in this process;
    returns (its output, its store's tracker, its sweep, {learning rate: trial})."""
    import yaml
    from typer.testing import CliRunner

    from pipeline.cli import app

    (directory / "spec.yaml").write_text(yaml.safe_dump({**document, "tracking": {"uri": store}}))
    result = CliRunner().invoke(app, ["run", str(directory / "spec.yaml")])
    assert result.exit_code == 0, result.output
    tracker, sweep, trials = latest_sweep(store, document["name"])
    return result.output, tracker, sweep, {float(trial.params["learning_rate"]): trial for trial in trials}


# -- data ---------------------------------------------------------------------------------------


def binary_data(n: int = 600, seed: int = 0) -> tuple[Any, Any]:
    """Two classes (0/1) told apart by the sign of a bump in a noisy 16-step signal."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n).astype(np.int32)
    x = rng.normal(size=(n, 16, 1)).astype(np.float32)
    x[:, 4:8, 0] += (2 * y - 1)[:, None] * 0.8
    return x, y


def mnist1d(num_samples: int) -> Any:
    from pipeline.inputs.datasets import load_dataset
    from pipeline.inputs.spec import DatasetSpec

    return load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": num_samples}))


def stratified_folds(dataset: Any, n_splits: int = 2) -> list[Any]:
    from pipeline.inputs.folds import make_folds
    from pipeline.inputs.spec import CVSpec

    return make_folds(CVSpec(splitter="stratified", n_splits=n_splits, seed=0), dataset).folds


def mnist1d_folds(num_samples: int) -> tuple[Any, list[Any]]:
    """(the mnist1d dataset of ``num_samples``, its two stratified folds, seed 0): what the
    modules that build fold trainers in this process train on."""
    dataset = mnist1d(num_samples)
    return dataset, stratified_folds(dataset)


def mnist1d_fixtures(num_samples: int) -> tuple[Any, Any]:
    """The module-scoped fixtures ``dataset`` and ``folds`` of ``mnist1d_folds``, for a module
    to take as ``dataset, folds = mnist1d_fixtures(n)``."""

    @pytest.fixture(scope="module", name="dataset")
    def dataset() -> Any:
        return mnist1d(num_samples)

    @pytest.fixture(scope="module", name="folds")
    def folds(dataset: Any) -> list[Any]:
        return stratified_folds(dataset)

    return dataset, folds


# -- servers ------------------------------------------------------------------------------------


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
    server = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, **popen
    )
    try:

        def listening() -> bytes | None:
            assert server.poll() is None, f"{what} exited"
            return answers(f"{url}/health")

        wait_for(listening, seconds=120, what=what)
        yield server
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def write_image_folder(root: Path, images: Any, labels: Any, names: Any = None) -> Path:
    """Keras' image_dataset_from_directory layout: root/<class>/<n>.png."""
    import numpy as np
    from PIL import Image

    for i, (image, label) in enumerate(zip(images, labels)):
        folder = root / (names[label] if names else f"class_{label}")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.asarray(image).round().astype(np.uint8).squeeze()).save(folder / f"{i:04d}.png")
    return root
