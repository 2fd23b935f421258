"""The local Ray a sweep starts: its token in no file and no place another user of the machine can read."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import psutil
import pytest

from pipeline.sweep import LOCAL_RAY_SETTINGS, give_ray_a_private_token


def test_a_process_without_a_token_gets_a_new_random_one():
    first, second = {}, {"RAY_AUTH_TOKEN": ""}  # an empty one is none to Ray

    give_ray_a_private_token(first)
    give_ray_a_private_token(second)

    assert re.fullmatch(r"[0-9a-f]{64}", first["RAY_AUTH_TOKEN"])
    assert re.fullmatch(r"[0-9a-f]{64}", second["RAY_AUTH_TOKEN"])
    assert first["RAY_AUTH_TOKEN"] != second["RAY_AUTH_TOKEN"]


def test_a_second_local_ray_of_the_process_keeps_its_token():
    environ = {}
    give_ray_a_private_token(environ)
    token = environ["RAY_AUTH_TOKEN"]

    give_ray_a_private_token(environ)

    assert environ == {"RAY_AUTH_TOKEN": token}


@pytest.mark.parametrize(
    "own", [{"RAY_AUTH_TOKEN": "researchers-own"}, {"RAY_AUTH_TOKEN_PATH": "/home/me/.secrets/ray_token"}]
)
def test_the_researchers_own_token_is_kept(own):
    environ = dict(own)

    give_ray_a_private_token(environ)

    assert environ == own


def _holds(path: Path, token: bytes) -> bool:
    try:
        return token in path.read_bytes()
    except OSError:  # a socket, or a file gone since it was listed
        return False


@pytest.mark.e2e
def test_the_local_ray_takes_its_token_from_the_environment_and_writes_it_nowhere(ray_cluster):
    """The session's Ray, started as `foldsweep run` starts its own: its driver and its workers
    authenticate with the token of this process's environment, which no file, no command line and
    no worker environment readable by another user holds."""
    import ray
    from ray._raylet import AuthenticationTokenLoader

    token = AuthenticationTokenLoader.instance().get_raw_token(ignore_auth_mode=True)
    assert token == os.environ.get("RAY_AUTH_TOKEN"), "the driver connected with a token not RAY_AUTH_TOKEN's"

    @ray.remote(num_cpus=0)
    def worker() -> tuple[int, bool]:
        return os.getpid(), os.environ.get("RAY_AUTH_TOKEN") == token

    pid, inherited = ray.get(worker.remote())
    assert inherited, "a Ray worker authenticates with the token of its environment"
    environ = dict(
        entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in entry
    )
    # the table's values, or the researcher's own where the environment already held one
    assert {name: environ.get(name) for name in LOCAL_RAY_SETTINGS} == {
        name: os.environ[name] for name in LOCAL_RAY_SETTINGS
    }
    assert os.stat(f"/proc/{pid}/environ").st_mode & 0o077 == 0, "a worker's environment is its owner's alone"
    secret = token.encode()
    assert not _holds(Path.home() / ".ray" / "auth_token", secret)
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    assert [path for path in session.rglob("*") if path.is_file() and _holds(path, secret)] == []
    assert [path for path in Path("/proc").glob("[0-9]*/cmdline") if _holds(path, secret)] == []


def _opening(tmp_path, monkeypatch, *, exists: bool, resume: bool = False):
    """What ``_open_tracker`` did, with connect_ray standing in for Ray: whether the store was
    already made when Ray started to start, and whether it was made while Ray started."""
    import threading
    from types import SimpleNamespace

    from pipeline import sweep
    from pipeline.records.tracking import Tracker

    database = tmp_path / "mlflow.db"
    uri = f"sqlite:///{database}"
    if exists:
        Tracker(uri)
    made = threading.Event()

    class Made(Tracker):
        def __init__(self, uri):
            super().__init__(uri)
            made.set()

    seen = {}

    def connect(address):
        seen["made before"] = made.is_set()
        seen["made while"] = made.wait(timeout=120)

    monkeypatch.setattr(sweep, "Tracker", Made)
    monkeypatch.setattr(sweep, "connect_ray", connect)
    prepared = SimpleNamespace(tracking_uri=uri, address=None, spec=SimpleNamespace(name="s"))
    return seen, lambda: sweep._open_tracker(prepared, resume=resume, start_ray=True)


def test_a_new_store_is_made_while_ray_starts(tmp_path, monkeypatch):
    seen, open_tracker = _opening(tmp_path, monkeypatch, exists=False)
    tracker, resumable = open_tracker()
    assert seen == {"made before": False, "made while": True}  # Ray waited for nothing
    assert resumable is None and tracker.experiment_id("s")
    assert (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("resume", [False, True])
def test_a_store_that_exists_is_opened_before_ray_starts(tmp_path, monkeypatch, resume):
    from pipeline.base.errors import TrackingError

    seen, open_tracker = _opening(tmp_path, monkeypatch, exists=True, resume=resume)
    if resume:  # nothing to resume: said before Ray starts
        with pytest.raises(TrackingError, match="^SWEEP: no sweep named 's' in sqlite:///"):
            open_tracker()
        assert seen == {}
    else:
        open_tracker()
        assert seen == {"made before": True, "made while": True}


def test_the_raylet_of_a_local_head_is_given_the_ports_it_would_wait_for_its_agents_to_write(tmp_path, monkeypatch):
    """The minimal dashboard agent's ports (-1: no service) are in the session directory, and the
    runtime env agent has a port, before the raylet starts."""
    from types import SimpleNamespace

    from ray._private import node
    from ray._raylet import (
        DASHBOARD_AGENT_LISTEN_PORT_NAME,
        METRICS_AGENT_PORT_NAME,
        METRICS_EXPORT_PORT_NAME,
        wait_for_persisted_port,
    )

    from pipeline.base.ray_private import lean_local_head

    node_id = "ab" * 28
    seen = {}

    def start_raylet(self, *arguments, **keywords):
        names = (METRICS_AGENT_PORT_NAME, METRICS_EXPORT_PORT_NAME, DASHBOARD_AGENT_LISTEN_PORT_NAME)
        seen["ports"] = [wait_for_persisted_port(str(tmp_path), node_id, name, timeout_ms=0) for name in names]
        seen["runtime env agent"] = self._ray_params.runtime_env_agent_port

    monkeypatch.setattr(node.Node, "start_raylet", start_raylet)
    head = SimpleNamespace(
        _session_dir=str(tmp_path),
        _node_id=node_id,
        _ray_params=SimpleNamespace(runtime_env_agent_port=0),
        _get_unused_port=lambda: 43210,
    )
    with lean_local_head():
        node.Node.start_raylet(head)
    assert seen == {"ports": [-1, -1, -1], "runtime env agent": 43210}
    assert node.Node.start_raylet is start_raylet  # Ray's own again after the start


def test_the_raylet_of_a_local_head_starts_a_stand_in_for_the_minimal_dashboard_agent(tmp_path, monkeypatch):
    """Its command for the dashboard agent is the stand-in's; every other argument, and every
    other process's command, as Ray made them."""
    import shlex
    import sys
    from types import SimpleNamespace

    from ray._private import node, ray_constants, services

    from pipeline.base.ray_private import DASHBOARD_AGENT_STAND_IN, lean_local_head

    launched = []
    monkeypatch.setattr(services, "start_ray_process", lambda command, kind, **_: launched.append((kind, command)))
    raylet = [
        "raylet",
        "--dashboard_agent_command=python agent.py --minimal",
        "--runtime_env_agent_command=python m.py",
    ]

    def start_raylet(self):
        services.start_ray_process(list(raylet), ray_constants.PROCESS_TYPE_RAYLET)
        services.start_ray_process(
            ["gcs_server", "--dashboard_agent_command=kept"], ray_constants.PROCESS_TYPE_GCS_SERVER
        )

    monkeypatch.setattr(node.Node, "start_raylet", start_raylet)
    head = SimpleNamespace(
        _session_dir=str(tmp_path), _node_id="ab" * 28, _ray_params=SimpleNamespace(runtime_env_agent_port=1)
    )
    recorder = services.start_ray_process
    with lean_local_head():
        node.Node.start_raylet(head)

    (kind, command), other = launched
    assert kind == ray_constants.PROCESS_TYPE_RAYLET
    assert command[0] == "raylet" and command[2:] == raylet[2:]
    name, agent = command[1].split("=", 1)
    assert name == "--dashboard_agent_command"
    assert shlex.split(agent) == [sys.executable, "-S", "-c", DASHBOARD_AGENT_STAND_IN]
    assert other == (ray_constants.PROCESS_TYPE_GCS_SERVER, ["gcs_server", "--dashboard_agent_command=kept"])
    assert services.start_ray_process is recorder  # Ray's own again after the start


def _commands_of_children(pid: int) -> list[str]:
    """The command lines of process ``pid``'s children (a title a process gave itself included)."""
    commands = []
    for child in psutil.Process(pid).children():
        with contextlib.suppress(psutil.NoSuchProcess):  # it ended meanwhile
            commands.append(" ".join(child.cmdline()))
    return commands


def test_the_dashboard_agent_stand_in_ends_once_its_parent_is_gone():
    """As the agent it stands in for does: a raylet killed leaves none behind."""
    import subprocess
    import sys

    from pipeline.base.processes import wait_until_ended
    from pipeline.base.ray_private import DASHBOARD_AGENT_STAND_IN

    # The parent starts the stand-in as the raylet starts its agents, says its pid and ends at once.
    start = (
        "import os, subprocess, sys\n"
        "environment = {**os.environ, 'RAY_RAYLET_PID': str(os.getpid())}\n"
        "quiet = {'stdout': subprocess.DEVNULL, 'stderr': subprocess.DEVNULL}\n"
        "print(subprocess.Popen(sys.argv[1:], env=environment, **quiet).pid)"
    )
    stand_in = [sys.executable, "-S", "-c", DASHBOARD_AGENT_STAND_IN, "--node-id=ab"]
    pid = int(
        subprocess.run([sys.executable, "-c", start, *stand_in], capture_output=True, text=True, check=True).stdout
    )
    try:
        process = psutil.Process(pid)
    except psutil.NoSuchProcess:  # it has ended already
        return
    left = wait_until_ended([process], timeout_s=30)  # its end comes within a second
    for survivor in left:
        survivor.kill()
    assert left == []


@pytest.mark.e2e  # a real Ray, and a worker started for a runtime environment
def test_the_local_ray_runs_only_what_a_sweep_uses(ray_cluster):
    """No API server (it would run Ray's usage statistics alone), autoscaler monitor, log
    monitor or dashboard agent (a stand-in in its place); its workers still get their runtime
    environments from the runtime env agent."""
    import ray
    from ray._private import ray_constants, worker

    from pipeline.base.ray_private import DASHBOARD_AGENT_STAND_IN

    @ray.remote(num_cpus=0, runtime_env={"env_vars": {"FOLDSWEEP_PROBE": "42"}})
    def answer():
        return int(os.environ["FOLDSWEEP_PROBE"])

    assert ray.get(answer.remote()) == 42
    started = set(worker._global_node.all_processes)
    raylet = worker._global_node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    started_by_raylet = _commands_of_children(raylet)  # its agents and workers
    assert not any("dashboard/agent.py" in command or "DashboardAgent" in command for command in started_by_raylet)
    assert sum(DASHBOARD_AGENT_STAND_IN in command for command in started_by_raylet) == 1
    assert sum(command.startswith("ray::RuntimeEnvAgent") for command in started_by_raylet) == 1  # its title
    assert ray_constants.PROCESS_TYPE_GCS_SERVER in started and ray_constants.PROCESS_TYPE_RAYLET in started
    unused = {
        ray_constants.PROCESS_TYPE_DASHBOARD,
        ray_constants.PROCESS_TYPE_MONITOR,
        ray_constants.PROCESS_TYPE_LOG_MONITOR,
    }
    assert started & unused == set()


WHERE_TRIALS_START = """
import json, os, sys, tempfile, time
from ray import tune
from pipeline.base.ray_private import trial_actors_in_workers_started_ahead
from pipeline.sweep import start_local_ray, stop_ray

class Where(tune.Trainable):
    def setup(self, config):
        from pipeline.base import loaded
        self.where = {"ahead": loaded.first_trial_started(now := time.perf_counter()) == now, "keras": "keras" in sys.modules}

    def step(self):
        return {**self.where, "done": True}

start_local_ray(num_cpus=2)
with tempfile.TemporaryDirectory() as results, trial_actors_in_workers_started_ahead():
    tuner = tune.Tuner(
        tune.with_resources(Where, {"cpu": 1}),
        param_space={"trial": tune.grid_search([0, 1])},
        run_config=tune.RunConfig(storage_path=results, verbose=0),
    )
    print(json.dumps([{"ahead": r.metrics["ahead"], "keras": r.metrics["keras"]} for r in tuner.fit()]))
stop_ray()
"""


@pytest.mark.e2e
def test_a_sweeps_first_trials_start_in_workers_that_loaded_foldsweep_ahead():
    """A new local Ray starts a worker per CPU as the driver connects, each loading foldsweep (and
    TensorFlow, Keras) at once; Ray Tune places the first trials in those, whose time account
    then starts at their set-up."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", WHERE_TRIALS_START], capture_output=True, text=True, timeout=300, check=True
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [{"ahead": True, "keras": True}] * 2
