"""A newcomer's sweep, as a process: the installed command run in a scratch directory writes
only the store it was told to (with its artifacts and Ray's files beside it), prints foldsweep's
own lines and no TensorFlow logging, shows every trial's run id, and ends with a rerun command
that works as printed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import MNIST1D_EXPERIMENT, REPO, curve, latest_sweep

from pipeline.records.tracking import Tag

pytestmark = pytest.mark.e2e

INSTALLED = Path(sys.executable).parent / "foldsweep"
TENSORFLOW_LOG_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\]|absl::InitializeLog|oneDNN|cuda", re.MULTILINE)


def installed(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(INSTALLED), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(REPO)},
    )


@pytest.fixture(scope="module")
def scratch_sweep(tmp_path_factory):
    assert INSTALLED.exists(), "the foldsweep command is installed beside the interpreter (make install)"
    scratch = tmp_path_factory.mktemp("scratch")
    (scratch / "spec.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "newcomer",
                "experiment": str(MNIST1D_EXPERIMENT),
                "dataset": {"name": "mnist1d", "num_samples": 300},
                "cv": {"n_splits": 2},
                "train": {"epochs": 2, "refit": False},
                "search": {
                    "num_samples": 2,
                    "space": {"conv_layers": 1, "filters": 16, "learning_rate": {"loguniform": [0.001, 0.01]}},
                },
            }
        )
    )
    ran = installed("run", "spec.yaml", cwd=scratch)
    return scratch, ran


def test_a_sweep_in_a_scratch_directory_writes_only_its_store(scratch_sweep):
    scratch, ran = scratch_sweep
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert sorted(path.name for path in scratch.iterdir()) == ["mlartifacts", "mlflow.db", "ray_results", "spec.yaml"]


def test_the_terminal_shows_foldsweeps_lines_and_no_library_logging(scratch_sweep):
    _, ran = scratch_sweep
    output = ran.stdout + ran.stderr
    assert not TENSORFLOW_LOG_LINE.search(output), output
    assert "Warning" not in output, output
    assert ran.stderr == "", ran.stderr
    # Into a log (not a terminal): a plain line per finished trial, no live table's control characters.
    finished = re.findall(r"^  trial-\d{5} \([0-9a-f]{8}\): ok \(mean_val_accuracy ", ran.stdout, re.MULTILINE)
    assert len(finished) == 2, ran.stdout
    assert not any(character in ran.stdout for character in ("\x1b", "\r")), "no terminal control characters"
    assert "Open the MLflow UI on this sweep" in ran.stdout and "viewStateShareKey=" in ran.stdout


def test_the_leaderboard_shows_run_ids_and_its_rerun_command_works_as_printed(scratch_sweep):
    from pipeline.records.tracking import Tracker

    scratch, ran = scratch_sweep
    uri = f"sqlite:///{scratch / 'mlflow.db'}"
    tracker, _, trials = latest_sweep(uri, "newcomer")
    for trial in trials:
        assert re.search(rf"│\s+\d\s+│ {trial.run_id[:8]} │ trial-\d+ ", ran.stdout), ran.stdout
        assert trial.tags["mlflow.source.name"] == "foldsweep run spec.yaml"  # the command as typed
        assert re.fullmatch(r"trial-\d{5} learning_rate=\S+ .*", trial.run_name), trial.run_name
        assert Tracker(uri).trial_run_id(trial.tags[Tag.TRIAL_ID]) == trial.run_id
    command = re.search(r"^rerun the best trial: (.*)$", ran.stdout, re.MULTILINE).group(1)
    best = next(trial for trial in trials if trial.run_id.startswith(shlex.split(command)[2]))
    assert shlex.split(command)[0] == str(INSTALLED)
    elsewhere = scratch.parent  # the command holds the store's absolute path: it works from anywhere
    again = subprocess.run(
        shlex.split(command),
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert again.returncode == 0, again.stdout + again.stderr
    rerun = tracker.reruns(best.run_id)[0]
    assert rerun.tags["mlflow.source.name"] == shlex.join(["foldsweep", *shlex.split(command)[1:]])
    for k in range(2):
        key = f"split{k}_val_loss"
        recorded = curve(uri, best.run_id, key)
        replayed = curve(uri, rerun.run_id, key)
        assert len(recorded) == 2 and replayed == pytest.approx(recorded, rel=1e-6, abs=0)
