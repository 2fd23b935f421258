"""The fixtures tests ask for by name: tiny specs and experiment files written into temp dirs,
empty stores, the session's Ray cluster and its one recorded sweep. The run's machinery (xdist
scheduling, each worker set up as a trial worker, the one local Ray) is the plugin
run_machinery.py; what tests share that is not a fixture is helpers.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

# helpers' assertions (a rerun reproducing its trial, say) explained as a test's are.
pytest.register_assert_rewrite("helpers")
from helpers import TINY_SPEC, Latest, Replace, latest_sweep, merged, seed_store  # noqa: E402

if TYPE_CHECKING:  # imported by pytest as a plugin, first: assertion rewriting applies to it
    from run_machinery import LocalRay

pytest_plugins = ["run_machinery"]


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
    """No Ray running, for a test that shows a command refuses with no Ray left running (before
    Ray starts, or after it started and was stopped)."""
    local_ray.stop()


# lr 50 without clipping diverges; with global-norm clipping at 0.1 it trains.
RECORDED_SPACE: dict[str, Any] = {
    "conv_layers": 1,
    "filters": 16,
    "kernel_size": 3,
    "dropout": 0.0,
    "optimizer": "sgd",
    "batch_size": 8,
    "learning_rate": {"grid": [0.01, 50.0]},
    "clipping": {"grid": ["none", "global_norm"]},
    "clip_threshold": 0.1,
}


@dataclass(frozen=True)
class RecordedSweep:
    directory: Path  # holds spec.yaml, data.npz and the store, mlflow.db
    uri: str
    exit_code: int
    output: str  # what `foldsweep run` printed
    delivered: tuple[dict, ...]  # every result Ray Tune handed the driver's MLflow callback, in order

    def records(self) -> Latest:
        """(tracker, sweep, trials), read afresh."""
        return latest_sweep(self.uri, "diverging")


@pytest.fixture
def empty_store(tmp_path: Path) -> Path:
    """tmp_path/mlflow.db, the store of ``write_spec``'s specs, as an empty MLflow store (seed_store)."""
    return seed_store(tmp_path / "mlflow.db")


@pytest.fixture(scope="session")
def recorded_sweep(local_ray: LocalRay, tmp_path_factory: pytest.TempPathFactory) -> RecordedSweep:
    """The session's one recorded sweep, for every test that reads a record (its runs, cv_results,
    plots, report, UI) or reruns one of its trials: 4 trials (lr 0.01 / 50 x clipping none /
    global_norm), one of them NaN, refit included (logged as a model, registered with the alias
    champion), on a data file (a rerun must notice when the data changes). Tests that rerun add runs tagged role=rerun; none changes the sweep's."""
    import numpy as np
    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.inputs.datasets import load_dataset
    from pipeline.inputs.spec import DatasetSpec
    from pipeline.records.callbacks import MlflowTrialCallback

    directory = tmp_path_factory.mktemp("recorded")
    uri = f"sqlite:///{seed_store(directory / 'mlflow.db')}"
    source = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 400}))
    np.savez(directory / "data.npz", x=source.x, y=source.y, x_test=source.x_test, y_test=source.y_test)
    spec = merged(
        TINY_SPEC,
        {
            "name": "diverging",
            "dataset": str(directory / "data.npz"),
            "search": {"num_samples": 1, "space": Replace(RECORDED_SPACE)},
            "train": {"refit": True},
            "tracking": {"uri": uri, "register_model": "diverging-cnn", "model_alias": True},
        },
    )
    (directory / "spec.yaml").write_text(yaml.safe_dump(spec))
    local_ray.ensure()
    delivered: list[dict] = []
    original = MlflowTrialCallback.on_trial_result

    def capture(self, iteration, trials, trial, result, **info):
        delivered.append(dict(result))
        original(self, iteration, trials, trial, result, **info)

    with pytest.MonkeyPatch.context() as patch:
        # MLflow's system metrics sampled every second (every 10 by default), so a short sweep has some.
        patch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
        patch.setattr(MlflowTrialCallback, "on_trial_result", capture)
        result = CliRunner().invoke(app, ["run", str(directory / "spec.yaml")])
    return RecordedSweep(directory, uri, result.exit_code, result.output, tuple(delivered))


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
