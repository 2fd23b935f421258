"""A sweep recorded by foldsweep 0.1.0 (before the package was split into layers) resumes and
reruns with today's code: Ray Tune's pickles name the old module paths, and the record is read
as it was written. The store is tests/fixtures/interrupted-0.1.0.tar.gz, made by
tests/fixtures/make_interrupted_store.py: 3 trials, interrupted by Ctrl-C after the first."""

from __future__ import annotations

import math
import sqlite3
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import sweep_runs
from pipeline.cli import app

pytestmark = pytest.mark.e2e

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "interrupted-0.1.0.tar.gz"
RECORDED_AT = "/tmp/foldsweep-fixture-root"


def unpack(directory: Path) -> None:
    """The store as if it had been recorded in ``directory``: MLflow keeps absolute artifact
    locations and foldsweep the Ray experiment's and the experiment file's paths, so all are
    rewritten (Ray Tune's own state is not: a resume makes its trials where the sweep is now)."""
    with tarfile.open(FIXTURE) as archive:
        archive.extractall(directory, filter="data")
    with sqlite3.connect(directory / "mlflow.db") as connection:
        for table, column in (("experiments", "artifact_location"), ("runs", "artifact_uri"), ("tags", "value"),
                              ("params", "value")):
            connection.execute(f"update {table} set {column} = replace({column}, ?, ?)", (RECORDED_AT, str(directory)))


@pytest.fixture(scope="module")
def old_sweep(tmp_path_factory, ray_cluster):
    directory = tmp_path_factory.mktemp("old-records")
    unpack(directory)
    client, parent, trials = sweep_runs(f"sqlite:///{directory / 'mlflow.db'}", "interrupted")
    return directory, parent, trials


def test_the_fixture_is_a_sweep_interrupted_after_its_first_trial(old_sweep):
    directory, parent, trials = old_sweep
    assert parent.data.tags["foldsweep.status"] == "interrupted"
    assert [run.data.tags["foldsweep.status"] for run in trials] == ["ok"]
    pickled = (next((directory / "ray_results").iterdir()) / "tuner.pkl").read_bytes()
    assert b"pipeline.tracking" in pickled and b"pipeline.records" not in pickled


def test_a_sweep_recorded_before_the_layers_resumes_and_its_trial_reruns(old_sweep, monkeypatch, threads_kept):
    directory, parent, before = old_sweep
    monkeypatch.chdir(directory)  # the spec's store is the zero-config sqlite:///mlflow.db
    uri = f"sqlite:///{directory / 'mlflow.db'}"
    client, _, _ = sweep_runs(uri, "interrupted")
    first = before[0]
    first_history = [metric.value for metric in client.get_metric_history(first.info.run_id, "mean_val_loss")]

    resumed = CliRunner().invoke(app, ["run", "spec.yaml", "--resume"])

    assert resumed.exit_code == 0, resumed.output
    client, parent_after, trials = sweep_runs(uri, "interrupted")
    assert parent_after.info.run_id == parent.info.run_id and parent_after.data.tags["foldsweep.resumes"] == "1"
    assert parent_after.data.tags["foldsweep.status"] == "ok"
    assert sorted(run.data.tags["foldsweep.trial_id"] for run in trials) == [
        f"{first.data.tags['foldsweep.trial_id'][:-1]}{k}" for k in range(3)]
    assert [run.data.tags["foldsweep.status"] for run in trials] == ["ok"] * 3
    # The trial the interrupted driver had not made yet is made where the sweep is now, not
    # at RECORDED_AT, where Ray would fail it (path gone) or write into another sweep's files.
    made_here = {path.name.split("_")[2] for path in (directory / "ray_results").glob("*/FoldTrainable_*")}
    assert made_here == {"00000", "00001", "00002"}
    again = next(run for run in trials if run.info.run_id == first.info.run_id)
    assert again.info.end_time == first.info.end_time
    assert [metric.value for metric in client.get_metric_history(first.info.run_id, "mean_val_loss")] == first_history

    rerun = CliRunner().invoke(app, ["rerun", first.info.run_id[:8], "--epochs", "1"])

    assert rerun.exit_code == 0, rerun.output
    reruns = [run for run in client.search_runs([parent.info.experiment_id])
              if run.data.tags.get("foldsweep.rerun_of") == first.info.run_id]
    assert len(reruns) == 1 and reruns[0].data.tags["foldsweep.status"] == "ok"
    rerun_loss = client.get_metric_history(reruns[0].info.run_id, "mean_val_loss")[0].value
    assert math.isclose(rerun_loss, first_history[0], rel_tol=1e-4), (rerun_loss, first_history[0])
