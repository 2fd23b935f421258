"""Hundreds of trials without a crash, and every sweep ends cleanly: workers retire before the
kernel's mapping limit, whatever fails after the trials closes the sweep, `foldsweep ui` stops
with its server, a fresh store survives a second opener, damaged input is bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import REPO, TINY_SPEC, Replace, answers, free_port, latest_sweep, merged
from typer.testing import CliRunner

from pipeline.base.processes import descendants, running, wait_until_ended
from pipeline.cli import app
from pipeline.records.tracking import Tag, Tracker

pytestmark = pytest.mark.e2e

GRID = {"conv_layers": 1, "dropout": 0.0, "kernel_size": {"grid": [3, 5]}, "filters": {"grid": [16, 32]}}


def write(tmp_path: Path, name: str, **overrides) -> Path:
    spec = merged(TINY_SPEC, {"name": name, "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}, **overrides})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_workers_retire_after_their_trials_and_nothing_else_changes(ray_cluster, tmp_path, empty_store):
    """A 4-trial grid, one trial at a time, in workers that retire every two trials, and half of it
    in workers that retire by a memory budget no worker fits (a fresh worker for every trial): the
    trials a reused worker ran score as a fresh worker's. (A worker kept for a whole sweep, never
    retiring: ``test_engine_e2e``.)"""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    scores = {}
    # The grid's second and fourth trials: each the second trial of a worker that retires after two.
    half_grid = {**GRID, "filters": 32}
    for name, grid, resources in (
        ("recycled", GRID, {"max_trials_per_worker": 2}),
        ("budgeted", half_grid, {"max_worker_memory": 1}),
    ):
        spec = write(
            tmp_path,
            name,
            search={"num_samples": 1, "space": Replace(grid)},
            train={"epochs": 1},
            resources={"max_concurrent": 1, **resources},
        )
        result = CliRunner().invoke(app, ["run", str(spec)])
        assert result.exit_code == 0, result.output
        _, _, trials = latest_sweep(uri, name)
        assert len(trials) == (2 if name == "budgeted" else 4) and all(run.state == "FINISHED" for run in trials)
        assert not any(Tag.RETRIES in run.tags for run in trials)
        scores[name] = {(run.params["kernel_size"], run.params["filters"]): run for run in trials}
        pids = [run.tags[Tag.of("pid")] for run in trials]
        retired = [run.tags.get(Tag.of("worker_retires"), "") for run in trials]
        assert all(run.metrics["worker_maps"] > 0 and run.metrics["worker_rss_mb"] > 100 for run in trials)
        if name == "recycled":
            assert len(set(pids)) == 2, "a fresh worker process every two trials"
            assert sorted(run.tags[Tag.of("worker_trials")] for run in trials) == ["1", "1", "2", "2"]
            # Each new process copied the data to its device once.
            assert {run.tags[Tag.of("data_transfers")] for run in trials} == {"1"}
            assert sorted(retired) == ["", "", *["ran 2 trials (resources.max_trials_per_worker)"] * 2]
        else:
            assert len(set(pids)) == 2, "a fresh worker process after every trial"
            assert all(reason.endswith("would pass resources.max_worker_memory (1 MiB)") for reason in retired)
    assert set(scores["budgeted"]) < set(scores["recycled"])
    reused = [scores["recycled"][key] for key in scores["budgeted"]]
    assert {run.tags[Tag.of("worker_trials")] for run in reused} == {"2"}, "each compared trial ran in a reused worker"
    for key, run in scores["budgeted"].items():
        assert run.metrics["mean_val_loss"] == pytest.approx(scores["recycled"][key].metrics["mean_val_loss"], rel=1e-6)


@pytest.mark.parametrize("what", ["refit", "plots"])
def test_what_fails_after_the_trials_closes_the_sweep_and_exits_1(
    ray_cluster, tmp_path, empty_store, monkeypatch, what
):
    import pipeline.records.publish
    import pipeline.refit

    def broken(*args, **kwargs):
        raise RuntimeError(f"{what} broke")

    # The refit breaks whether it trains beside the last trial or after it. The plots break in
    # the thread that draws them while the refit ends, which fails publishing (the tables, the
    # plots and the descriptions) as a failure of publishing itself would.
    broken_part = {"refit": (pipeline.refit.PreparedRefit, "train"), "plots": (pipeline.records.publish, "write_plots")}
    monkeypatch.setattr(*broken_part[what], broken)
    spec = write(
        tmp_path,
        what,
        search={"num_samples": 1, "space": {"kernel_size": 3}},
        train={"epochs": 1, "refit": True},
    )
    result = CliRunner().invoke(app, ["run", str(spec)])
    assert result.exit_code == 1, result.output
    assert "every trial ended and is recorded, but" in result.output and f"{what} broke" in result.output
    _, parent, trials = latest_sweep(f"sqlite:///{tmp_path / 'mlflow.db'}", what)
    assert trials and all(run.state == "FINISHED" for run in trials)
    if what == "refit":
        assert parent.state == "FINISHED" and parent.tags[Tag.REFIT].startswith("error: RuntimeError")
    else:  # publishing failed; the refit beside the plots stands
        assert parent.state == "FAILED" and "plots broke" in parent.tags[Tag.ERROR]
        assert parent.tags[Tag.REFIT] == "ok" and parent.tags[Tag.REFIT_MODEL].startswith("models:/")


def test_an_exception_in_the_mlflow_callback_leaves_nothing_running(ray_cluster, tmp_path, empty_store, monkeypatch):
    from pipeline.records.callbacks import MlflowTrialCallback

    def broken(self, *args, **kwargs):
        raise RuntimeError("the store went away")

    monkeypatch.setattr(MlflowTrialCallback, "on_trial_result", broken)
    spec = write(tmp_path, "callback", search={"num_samples": 1, "space": {"kernel_size": 3}}, train={"epochs": 1})
    result = CliRunner().invoke(app, ["run", str(spec)])
    assert result.exit_code == 1, result.output
    assert "the store went away" in result.output
    _, parent, trials = latest_sweep(f"sqlite:///{tmp_path / 'mlflow.db'}", "callback")
    assert parent.state == "FAILED" and all(run.state != "RUNNING" for run in trials)


def test_eight_concurrent_trials_record_every_epoch_once(ray_cluster, tmp_path, empty_store):
    """About 30 s alone, up to 120 s beside the other pytest worker: eight worker processes start
    TensorFlow at once on two cores (a quarter of a CPU each, so that the session's Ray holds all
    eight)."""
    spec = write(
        tmp_path,
        "eight",
        search={
            "num_samples": 8,
            "space": {"kernel_size": 3, "learning_rate": {"loguniform": [1e-3, 1e-2]}},
        },  # eight configs: a sweep repeats none
        train={"epochs": 2, "jit_compile": False},
        resources={"cpu": 0.25, "max_concurrent": 8},
    )
    result = CliRunner().invoke(app, ["run", str(spec)])
    assert result.exit_code == 0, result.output
    assert "locked" not in result.output
    tracker, _, trials = latest_sweep(f"sqlite:///{tmp_path / 'mlflow.db'}", "eight")
    assert len(trials) == 8 and all(run.state == "FINISHED" for run in trials)
    assert len({run.tags[Tag.of("pid")] for run in trials}) == 8, "eight workers, all at once"
    for run in trials:
        steps = [step for step, _ in tracker.metric_histories([run.run_id], "mean_val_loss")[run.run_id]]
        assert sorted(steps) == [1, 2]


def test_a_fresh_store_opened_by_a_second_process_at_once(ray_cluster, tmp_path, monkeypatch):
    """The sweep in this process, the other opener in a process of its own: both open the store
    the moment the other one is ready to."""
    monkeypatch.chdir(tmp_path)
    spec = write(tmp_path, "fresh", search={"num_samples": 1, "space": {"kernel_size": 3}}, train={"epochs": 1})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # The other opener is MLflow's own client: what races is the store's creation, not a record.
    poller = (
        "import sys, mlflow\nprint('ready', flush=True)\nclient = mlflow.MlflowClient(sys.argv[1])\n"
        "for _ in range(20):\n    client.search_experiments()\n"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", poller, uri],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert other.stdout.readline().strip() == "ready"
        result = CliRunner().invoke(app, ["run", str(spec)])
        other.wait(timeout=120)
    finally:
        if other.poll() is None:
            other.kill()
    assert result.exit_code == 0, result.output
    _, parent, trials = latest_sweep(uri, "fresh")
    assert parent.state == "FINISHED" and len(trials) == 1


def test_sigterm_stops_the_ui_and_everything_it_started(tmp_path):
    """`foldsweep ui` serves the store's experiments on loopback, and SIGTERM (a terminal's or a
    service manager's stop) stops it with MLflow's server and its workers: the port closes."""
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    Tracker(tracking_uri).experiment_id("shown-in-ui")
    port = free_port()
    ui = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "ui",
            "--tracking-uri",
            tracking_uri,
            "--port",
            str(port),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        printed = ui.stdout.readline()
        # The address the line gives opens at once: it is printed once the server answers.
        assert answers(re.search(r" at (http://127\.0\.0\.1:\d+\S*)", printed).group(1)), printed
        found = answers(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get-by-name?experiment_name=shown-in-ui")
        assert found is not None and json.loads(found)["experiment"]["name"] == "shown-in-ui"
        family = descendants(ui.pid)
        assert family, "the UI runs in a server process of its own"
        commands = [" ".join(process.cmdline()) for process in family if running(process)]
        assert not [command for command in commands if "huey" in command or "job" in command], commands
        ui.send_signal(signal.SIGTERM)
        assert ui.wait(timeout=60) == 0
        assert wait_until_ended(family, timeout_s=30) == []
        assert answers(f"http://127.0.0.1:{port}/health") is None
    finally:
        if ui.poll() is None:
            ui.kill()


def damaged_inputs(directory: Path) -> dict[str, tuple[Path, dict]]:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 8, 1)).astype(np.float32), np.arange(40) % 2
    np.savez(directory / "good.npz", x=x, y=y)
    good = (directory / "good.npz").read_bytes()
    (directory / "truncated.npz").write_bytes(good[: len(good) // 2])
    (directory / "random.npz").write_bytes(rng.bytes(2000))
    for name in ("truncated_npy", "random_npy"):
        (directory / name).mkdir()
        np.save(directory / name / "y.npy", y)
    np.save(directory / "truncated_npy" / "x.npy", x)
    full = (directory / "truncated_npy" / "x.npy").read_bytes()
    (directory / "truncated_npy" / "x.npy").write_bytes(full[: len(full) // 3])
    (directory / "random_npy" / "x.npy").write_bytes(rng.bytes(500))
    (directory / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    (directory / "binary.yaml").write_bytes(rng.bytes(300))
    (directory / "not_python.py").write_text("def build(hp):\n    return keras.Sequential([\n")
    return {
        "truncated .npz": (directory / "truncated.npz", {"dataset": str(directory / "truncated.npz")}),
        "random-byte .npz": (directory / "random.npz", {"dataset": str(directory / "random.npz")}),
        "truncated .npy": (directory / "truncated_npy" / "x.npy", {"dataset": str(directory / "truncated_npy")}),
        "random-byte .npy": (directory / "random_npy" / "x.npy", {"dataset": str(directory / "random_npy")}),
        "non-UTF-8 spec": (directory / "latin1.yaml", {}),
        "binary spec": (directory / "binary.yaml", {}),
        "experiment that is not Python": (
            directory / "not_python.py",
            {"experiment": f"{directory / 'not_python.py'}:build"},
        ),
    }


@pytest.mark.parametrize(
    "kind",
    [
        "truncated .npz",
        "random-byte .npz",
        "truncated .npy",
        "random-byte .npy",
        "non-UTF-8 spec",
        "binary spec",
        "experiment that is not Python",
    ],
)
def test_damaged_input_is_bad_input_naming_the_file(tmp_path, write_spec, kind):
    damaged, overrides = damaged_inputs(tmp_path)[kind]
    spec = damaged if damaged.suffix == ".yaml" else write_spec(overrides)
    for command in ("validate", "run"):
        result = CliRunner().invoke(app, [command, str(spec)])
        assert result.exit_code == 2, result.output
        assert str(damaged) in result.output.replace("\n", ""), result.output
        assert "Traceback" not in result.output and "internal error" not in result.output
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "ray_results").exists()
