"""Worker faults, a two-node Ray cluster on 127.0.0.1, and an MLflow server over HTTP."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from helpers import TINY_SPEC, free_port, merged, recorded_sweeps, serving, wait_for
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.records.tracking import Tag

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent


def trial_runs(uri: str, experiment: str):
    tracker, parents, trials = recorded_sweeps(uri, experiment)
    return tracker, trials, parents


def worker_pid(database: Path) -> int | None:
    """The pid a running trial reported, read straight from the SQLite store."""
    if not database.exists():
        return None
    try:
        with sqlite3.connect(database, timeout=5) as connection:
            row = connection.execute(
                "select t.value from tags t join metrics m on m.run_uuid = t.run_uuid "
                f"where t.key = '{Tag.of('pid')}' and m.key = 'mean_val_accuracy' limit 1"
            ).fetchone()
    except sqlite3.OperationalError:
        return None
    return int(row[0]) if row else None


def test_a_killed_worker_is_retried_and_the_sweep_completes(tmp_path, empty_store):
    spec = merged(
        TINY_SPEC,
        {
            "name": "faults",
            "dataset": {"num_samples": 1500},
            "search": {"num_samples": 1, "space": {"kernel_size": 3, "batch_size": 8}},
            # Epochs enough to outlast the poll that finds the first one.
            "train": {"epochs": 12},
            "resources": {"max_failures": 2},
            "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        },
    )
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    sweep = subprocess.Popen(
        [str(BIN / "foldsweep"), "run", "spec.yaml"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        pid = wait_for(lambda: worker_pid(tmp_path / "mlflow.db"), seconds=180, what="a trial's first epoch")
        os.kill(pid, signal.SIGKILL)
        output, _ = sweep.communicate(timeout=600)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 0, output
    _, trials, _ = trial_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "faults")
    assert len(trials) == 1
    trial = trials[0]
    assert trial.state == "FINISHED" and trial.tags[Tag.STATUS] == "ok"
    assert trial.tags[Tag.RETRIES] == "1" and trial.metrics["retries"] == 1
    assert int(trial.tags[Tag.of("pid")]) != pid  # finished in a new worker process


def started_node(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """`ray start ... --block` in a session of its own, once it says the node runs."""
    node = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    said = []
    for line in node.stdout:
        said.append(line)
        if "Ray runtime started" in line:
            break
    assert node.poll() is None, f"{' '.join(command[:3])} exited {node.wait(timeout=60)}:\n{''.join(said)}"
    return node


def session_processes(leader: int) -> list[int]:
    """The live processes of the session ``leader`` started: its Ray node's raylet, GCS and
    workers (which set process groups of their own), and nothing else on the machine."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            zombie = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            if not zombie and os.getsid(int(entry.name)) == leader:
                found.append(int(entry.name))
    return found


def end_session(leader: int) -> None:
    for pid in session_processes(leader):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def two_node_cluster(without_ray):
    """Two one-CPU Ray nodes on this machine, with a Ray temp dir of their own: `ray start` writes
    the address of its cluster there, where no other `ray.init` of this machine (the session's
    Ray, or another pytest worker's) looks for a cluster to join; and they are stopped by ending
    their own processes, where `ray stop` would end every Ray on the machine."""
    from ray._private.authentication_test_utils import reset_auth_token_state

    from pipeline.sweep import give_ray_a_private_token

    # Ray 2.60's `ray start` clusters authenticate with a token when RAY_AUTH_MODE=token; every
    # process that joins, the sweep's driver included, must say so and hold the token. As in the
    # recipe of docs/reliability.md, every node and the driver get the same RAY_AUTH_TOKEN: this
    # process's (its local Rays' too). Ray reads RAY_AUTH_MODE once per process (a local
    # `ray.init` sets it): its own test helper makes it read it again, here and once it is put back.
    give_ray_a_private_token(os.environ)
    mode_before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "token"
    reset_auth_token_state()
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's unix sockets live under it
    env = {**os.environ, "RAY_ADDRESS": ""}
    ray = str(BIN / "ray")
    node_options = ["--num-cpus=1", "--disable-usage-stats", f"--temp-dir={temp_dir}", "--block"]
    nodes = []
    try:
        nodes.append(
            started_node([ray, "start", "--head", f"--port={port}", "--include-dashboard=false", *node_options], env)
        )
        nodes.append(started_node([ray, "start", f"--address=127.0.0.1:{port}", *node_options], env))
        yield f"127.0.0.1:{port}"
    finally:
        for node in reversed(nodes):
            end_session(node.pid)
        if mode_before is None:
            del os.environ["RAY_AUTH_MODE"]
        else:
            os.environ["RAY_AUTH_MODE"] = mode_before
        reset_auth_token_state()
        for node in nodes:
            assert node.wait(timeout=60) == -signal.SIGKILL, "the node ran until it was stopped"
            assert wait_for(lambda: not session_processes(node.pid), seconds=60, what="the node's processes to end")
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_sweep_runs_on_a_two_node_ray_cluster(two_node_cluster, write_spec, empty_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # Two one-CPU trials at once on two one-CPU nodes: one on each. A worker retires after its
    # trial, so that none is kept to take a trial the other node could have run.
    spec = write_spec(
        {
            "name": "cluster",
            "search": {"num_samples": 2},
            "train": {"epochs": 1},
            "resources": {"max_concurrent": 2, "max_trials_per_worker": 1},
        }
    )

    result = CliRunner().invoke(app, ["run", str(spec), "--address", two_node_cluster])

    assert result.exit_code == 0, result.output
    _, trials, _ = trial_runs(f"sqlite:///{tmp_path / 'mlflow.db'}", "cluster")
    assert len(trials) == 2 and all(run.state == "FINISHED" for run in trials)
    assert len({run.tags[Tag.of("node_id")] for run in trials}) == 2, "trials ran on both nodes"


# The auth.ini of docs/reliability.md (its shared MLflow server recipe).
AUTH_CONFIG = """[mlflow]
default_permission = NO_PERMISSIONS
database_uri = sqlite:///{directory}/auth.db
admin_username = admin
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = 60
"""


def test_a_sweep_records_to_an_mlflow_server_that_lets_no_one_else_in(
    local_ray, without_ray, tmp_path, write_spec, monkeypatch
):
    """The basic-auth recipe of docs/reliability.md on loopback: without the credentials, or with wrong ones,
    the sweep is refused before Ray starts; with them, it records over HTTP, its refit's model
    registered as asked."""
    import ray
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "auth.ini").write_text(AUTH_CONFIG.format(directory=tmp_path))
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server_environment = {
        **os.environ,
        "MLFLOW_AUTH_CONFIG_PATH": str(tmp_path / "auth.ini"),
        "MLFLOW_AUTH_ADMIN_PASSWORD": "s3cret-Passphrase",
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "k" * 32,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    with serving(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--app-name",
            "basic-auth",
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            # One worker process: four (the default) start for seconds on two cores.
            "--workers",
            "1",
        ],
        url=uri,
        what="the MLflow server",
        cwd=tmp_path,
        env=server_environment,
    ):
        spec = write_spec({"name": "server", "search": {"num_samples": 1}, "train": {"epochs": 1, "refit": True}})
        before = sorted(path.name for path in tmp_path.iterdir())
        anonymous = CliRunner().invoke(app, ["run", str(spec), "--tracking-uri", uri])
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong")
        wrong = CliRunner().invoke(app, ["run", str(spec), "--tracking-uri", uri])
        for refused, phrase in (
            (anonymous, "asks for credentials: set MLFLOW_TRACKING_USERNAME"),
            (wrong, "refuses the credentials of MLFLOW_TRACKING_USERNAME"),
        ):
            assert refused.exit_code == 2, refused.output
            assert f"--tracking-uri: the MLflow server at '{uri}' {phrase}" in " ".join(refused.output.split())
        assert not ray.is_initialized()
        assert sorted(path.name for path in tmp_path.iterdir()) == before

        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-Passphrase")
        local_ray.ensure()
        registering = ["--register-model", "server-cnn", "--model-alias", "production"]
        result = CliRunner().invoke(app, ["run", str(spec), "--tracking-uri", uri, *registering])
        assert result.exit_code == 0, result.output
        tracker, trials, parents = trial_runs(uri, "server")
        assert len(parents) == 1 and len(trials) == 1 and trials[0].state == "FINISHED"
        artifacts = set(tracker.artifact_paths(parents[0].run_id))
        assert {"cv_results.csv", "spec.yaml", "refit_model.keras"} <= artifacts
        # The refit's model, logged and registered over HTTP (MLflow's own client reads its registry).
        production = MlflowClient(uri).get_model_version_by_alias("server-cnn", "production")
        assert (str(production.version), production.source) == ("1", parents[0].tags[Tag.REFIT_MODEL])
        assert "history.csv" in set(tracker.artifact_paths(trials[0].run_id))
        assert not (tmp_path / "mlflow.db").exists()
