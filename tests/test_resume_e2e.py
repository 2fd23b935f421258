"""Ctrl-C or a killed driver, then `foldsweep run --resume`: every trial ends exactly once."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import TINY_SPEC, merged, recorded_sweeps
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.records.tracking import Tag

pytestmark = pytest.mark.e2e

TRIALS = 4
EPOCHS = 8


def finished_trials(database: Path) -> int:
    if not database.exists():
        return 0
    try:
        with sqlite3.connect(database, timeout=5) as connection:
            return connection.execute(
                "select count(*) from runs r join tags t on t.run_uuid = r.run_uuid "
                f"where t.key = '{Tag.ROLE}' and t.value = 'trial' and r.status = 'FINISHED'"
            ).fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def unfinished_checkpoints(directory: Path) -> list[Path]:
    """The newest checkpoint of each trial the record does not hold as finished."""
    try:
        with sqlite3.connect(directory / "mlflow.db", timeout=5) as connection:
            finished = {
                row[0]
                for row in connection.execute(
                    "select t.value from runs r join tags t on t.run_uuid = r.run_uuid "
                    f"where t.key = '{Tag.TRIAL_ID}' and r.status = 'FINISHED'"
                )
            }
    except sqlite3.OperationalError:
        return []
    found = []
    for trial_dir in sorted((directory / "ray_results").glob("*/FoldTrainable_*")):
        checkpoints = sorted(trial_dir.glob("checkpoint_*"))
        if checkpoints and "_".join(trial_dir.name.split("_")[1:3]) not in finished:
            found.append(checkpoints[-1])
    return found


def runs(directory: Path):
    return recorded_sweeps(f"sqlite:///{directory / 'mlflow.db'}", "resume")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_an_interrupted_sweep_resumes_with_every_trial_recorded_once(ray_cluster, tmp_path, empty_store, stop):
    """About 45 s beside the other pytest worker: `foldsweep run` in a process of its own (it
    starts Ray and TensorFlow) stopped in mid-sweep, then resumed in this one."""
    spec = merged(
        TINY_SPEC,
        {
            "name": "resume",
            "dataset": {"num_samples": 1000},
            "search": {"num_samples": TRIALS, "space": {"kernel_size": 3, "batch_size": 8}},
            "train": {"epochs": EPOCHS},
            "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        },
    )
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    command = [str(Path(sys.executable).parent / "foldsweep"), "run", "spec.yaml"]
    sweep = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        # Waiting for progress, not timing anything; a kill -9 waits for a trial in the middle
        # of its epochs too.
        while finished_trials(tmp_path / "mlflow.db") < 2 or (
            stop == signal.SIGKILL and not unfinished_checkpoints(tmp_path)
        ):
            assert time.monotonic() < deadline and sweep.poll() is None, "the sweep made no progress"
            # A trial of this tiny sweep trains its 8 epochs in about a second on a fast machine:
            # looked for often enough, one is caught between two checkpoints.
            time.sleep(0.1)
        os.kill(sweep.pid, stop)
        output, _ = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    if stop == signal.SIGKILL:
        # What a kill between Ray Tune's checkpoint rotation and its state save leaves: the state
        # names a checkpoint that is gone, a newer one is on disk. The trial goes on from that one.
        newest = unfinished_checkpoints(tmp_path)[0]
        index = int(newest.name.removeprefix("checkpoint_"))
        newest.rename(newest.with_name(f"checkpoint_{index + 1:06d}"))

    tracker, parents, trials = runs(tmp_path)
    assert len(parents) == 1
    parent_id = parents[0].run_id
    done_before = {
        run.run_id: (run.ended_at, len(tracker.metric_histories([run.run_id], "mean_val_loss")[run.run_id]))
        for run in trials
        if run.state == "FINISHED"
    }
    assert 2 <= len(done_before) < TRIALS
    if stop == signal.SIGINT:
        assert sweep.returncode == 130, output
        # The command as it was run (not on the PATH here: by its path), to paste again.
        assert f"Resume with: {command[0]} run spec.yaml --resume" in " ".join(output.split()), output
        assert parents[0].state == "KILLED" and parents[0].tags[Tag.STATUS] == "interrupted"
        assert all(run.state in ("FINISHED", "KILLED") for run in trials)

    resumed = CliRunner().invoke(app, ["run", str(tmp_path / "spec.yaml"), "--resume"])

    assert resumed.exit_code == 0, resumed.output
    assert f"resuming sweep resume (run {parent_id}): {len(done_before)} of {TRIALS} trials done" in resumed.output
    left = TRIALS - len(done_before)
    assert f"{left} trial{'s' if left > 1 else ''} trained in " in resumed.output
    assert f"({TRIALS} in the sweep, {len(done_before)} ended before this resume)" in resumed.output
    tracker, parents, trials = runs(tmp_path)
    assert [parent.run_id for parent in parents] == [parent_id]
    assert parents[0].state == "FINISHED" and parents[0].tags[Tag.RESUMES] == "1"
    assert len(trials) == TRIALS
    assert len({run.tags[Tag.TRIAL_ID] for run in trials}) == TRIALS
    assert all(run.state == "FINISHED" and run.tags[Tag.STATUS] == "ok" for run in trials)
    for run in trials:
        history = tracker.metric_histories([run.run_id], "mean_val_loss")[run.run_id]
        assert sorted(step for step, _ in history) == list(range(1, EPOCHS + 1)), "each epoch recorded once"
        if run.run_id in done_before:  # finished before the stop: not trained again
            assert (run.ended_at, len(history)) == done_before[run.run_id]


def test_resume_refuses_a_finished_sweep(tmp_path, write_spec, monkeypatch):
    from pipeline.contract.results import SweepStatus
    from pipeline.records.tracking import Tracker

    monkeypatch.chdir(tmp_path)
    spec = write_spec({"name": "done"})
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent, _ = tracker.start_sweep(
        name="done",
        spec_text="",
        manifest={},
        params={},
        ray_path_for=lambda run_id: str(tmp_path / "ray_results" / run_id),
    )
    tracker.end_sweep(parent, status=SweepStatus.OK, summary={})
    result = CliRunner().invoke(app, ["run", str(spec), "--resume"])
    assert result.exit_code == 2
    assert "finished; nothing to resume" in result.output
    assert not (tmp_path / "ray_results").exists()
    nothing = CliRunner().invoke(app, ["run", str(write_spec({"name": "never-ran"})), "--resume"])
    assert nothing.exit_code == 2 and "no sweep named 'never-ran'" in nothing.output
