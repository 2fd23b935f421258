"""Sweeps recorded by earlier releases resume and rerun with today's code: Ray Tune's pickles
name the old module paths, and the record is read as it was written. Each store is made by
tests/fixtures/make_interrupted_store.py (3 trials, interrupted by Ctrl-C after the first):
- interrupted-0.1.0.tar.gz, by foldsweep 0.1.0 (commit 24cc5ba), before the package was split
  into layers (6d30924);
- interrupted-31e017e.tar.gz, by commit 31e017e, the last before the engine's modules and
  classes were renamed (after 31e017e)."""

from __future__ import annotations

import math
import sqlite3
import tarfile
from pathlib import Path

import pytest
from helpers import curve, latest_sweep
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.records.tracking import Tag, Tracker

pytestmark = pytest.mark.e2e

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Each fixture: the module paths its Ray Tune state names (and does not), and the statuses its
# trial runs hold (31e017e records the trial it had started when interrupted, as killed).
RELEASES = {
    "0.1.0": (b"pipeline.tracking", b"pipeline.records", ["ok"]),
    "31e017e": (b"pipeline.records.callbacks", b"pipeline.tracking", ["killed", "ok"]),
}
RECORDED_AT = "/tmp/foldsweep-fixture-root"


def unpack(directory: Path, release: str) -> None:
    """The store as if it had been recorded in ``directory``: MLflow keeps absolute artifact
    locations and foldsweep the Ray experiment's and the experiment file's paths, so all are
    rewritten (Ray Tune's own state is not: a resume makes its trials where the sweep is now)."""
    with tarfile.open(FIXTURES / f"interrupted-{release}.tar.gz") as archive:
        archive.extractall(directory, filter="data")
    with sqlite3.connect(directory / "mlflow.db") as connection:
        for table, column in (
            ("experiments", "artifact_location"),
            ("runs", "artifact_uri"),
            ("tags", "value"),
            ("params", "value"),
        ):
            connection.execute(f"update {table} set {column} = replace({column}, ?, ?)", (RECORDED_AT, str(directory)))


@pytest.fixture(scope="module", params=sorted(RELEASES))
def old_sweep(request, tmp_path_factory, ray_cluster):
    directory = tmp_path_factory.mktemp(f"old-records-{request.param}")
    unpack(directory, request.param)
    _, parent, trials = latest_sweep(f"sqlite:///{directory / 'mlflow.db'}", "interrupted")
    return directory, parent, trials, request.param


def test_the_fixture_is_a_sweep_interrupted_after_its_first_trial(old_sweep):
    directory, parent, trials, release = old_sweep
    assert parent.tags[Tag.STATUS] == "interrupted"
    named, not_named, statuses = RELEASES[release]
    assert sorted(run.tags[Tag.STATUS] for run in trials) == statuses
    pickled = (next((directory / "ray_results").iterdir()) / "tuner.pkl").read_bytes()
    assert named in pickled and not_named not in pickled


def test_a_sweep_recorded_by_an_earlier_release_resumes_and_its_trial_reruns(old_sweep, monkeypatch, threads_kept):
    directory, parent, before, release = old_sweep
    monkeypatch.chdir(directory)  # the spec's store is the zero-config sqlite:///mlflow.db
    uri = f"sqlite:///{directory / 'mlflow.db'}"
    # MLflow keeps one database engine per store URI in a process: the relative URI would reach
    # the store of the release resumed first here. The first release is resumed on the
    # zero-config store, the others on theirs named absolutely.
    store = [] if release == "0.1.0" else ["--tracking-uri", uri]
    tracker = Tracker(uri)
    first = next(run for run in before if run.tags[Tag.STATUS] == "ok")
    first_history = curve(uri, first.run_id, "mean_val_loss")

    resumed = CliRunner().invoke(app, ["run", "spec.yaml", "--resume", *store])

    assert resumed.exit_code == 0, resumed.output
    tracker, parent_after, trials = latest_sweep(uri, "interrupted")
    assert parent_after.run_id == parent.run_id and parent_after.tags[Tag.RESUMES] == "1"
    assert parent_after.tags[Tag.STATUS] == "ok"
    assert sorted(run.tags[Tag.TRIAL_ID] for run in trials) == [f"{first.tags[Tag.TRIAL_ID][:-1]}{k}" for k in range(3)]
    assert [run.tags[Tag.STATUS] for run in trials] == ["ok"] * 3
    # The trial the interrupted driver had not made yet is made where the sweep is now, not
    # at RECORDED_AT, where Ray would fail it (path gone) or write into another sweep's files.
    made_here = {path.name.split("_")[2] for path in (directory / "ray_results").glob("*/FoldTrainable_*")}
    assert made_here == {"00000", "00001", "00002"}
    again = next(run for run in trials if run.run_id == first.run_id)
    assert again.ended_at == first.ended_at
    assert curve(uri, first.run_id, "mean_val_loss") == first_history

    rerun = CliRunner().invoke(app, ["rerun", first.run_id[:8], "--epochs", "1", *store])

    assert rerun.exit_code == 0, rerun.output
    reruns = tracker.reruns(first.run_id)
    assert len(reruns) == 1 and reruns[0].tags[Tag.STATUS] == "ok"
    rerun_loss = curve(uri, reruns[0].run_id, "mean_val_loss")[0]
    assert math.isclose(rerun_loss, first_history[0], rel_tol=1e-4), (rerun_loss, first_history[0])
