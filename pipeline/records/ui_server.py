"""The MLflow UI's server on a tracking store (``foldsweep ui``): started on 127.0.0.1 opening on a
sweep's view, waited for until it answers, and stopped with every process it started.

MLflow's UI runs a server with worker processes of its own; started in a session of its own, the
whole group can be stopped, so that stopping ``foldsweep ui`` (Ctrl-C, ``kill``, a closed terminal
or a process manager) leaves nothing running. Importing this module loads no more than the
standard library and foldsweep's errors: the command line takes ``DEFAULT_UI_PORT`` from it as it
starts.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from pipeline.base.errors import FoldsweepError, InputError

DEFAULT_UI_PORT = 5000


def ui_command(tracking_uri: str, *, sweep: str | None = None) -> str:
    """The exact command that opens the UI on this store, as the user can paste it in any
    directory."""
    from pipeline.base.environment import program_name
    from pipeline.records.stores import pasteable_uri

    named = f" {shlex.quote(sweep)}" if sweep else ""
    return f"{program_name()} ui{named} --tracking-uri {shlex.quote(pasteable_uri(tracking_uri))}"


class ServerEnded(FoldsweepError):
    """The server ended before it answered; the command ends with the server's exit code, or 1
    for its 0 (``mlflow ui`` ends with 0 even when its port is taken)."""

    def __init__(self, code: int, address: str):
        super().__init__(f"the MLflow UI server exited with code {code} before it answered at {address}")
        self.exit_code = code or 1


def serve_ui(tracking_uri: str, *, sweep: str | None, port: int, on_open: Callable[[str], None]) -> int:
    """Serve the MLflow UI on 127.0.0.1:``port`` for ``tracking_uri``, opening on the shared view of
    ``sweep`` (a name or parent run id; None: the latest sweep, if any), until it is stopped or
    ends. Calls ``on_open`` with the address once the server answers (MLflow takes seconds to
    start).

    Returns the exit code the command ends with: 0 when it was stopped (Ctrl-C, SIGTERM, SIGHUP),
    else the server's own.

    Raises:
        InputError: a bad URI or port, another server on the port, or no such sweep.
        ServerEnded: the server ended before it answered.
        FoldsweepError: the server did not answer in time (it is stopped).
    """
    import socket

    from pipeline.base.errors import TrackingError
    from pipeline.base.mlflow_private import MLFLOW_JOB_EXECUTION_VARIABLE
    from pipeline.base.private_hooks import require_hooks
    from pipeline.base.processes import stop_process_tree
    from pipeline.records.publish import share_view
    from pipeline.records.stores import check_tracking_uri
    from pipeline.records.tracking import Tracker

    check_tracking_uri(tracking_uri, source="--tracking-uri")
    if not 0 < port < 65536:
        raise InputError(f"--port must be between 1 and 65535, got {port}")
    # Another server there would answer for ours, whose address would then open that one.
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise InputError(
                f"--port: a server already listens on 127.0.0.1:{port} (another foldsweep ui or MLflow "
                f"UI?): stop it or choose another --port"
            )
    require_hooks(["mlflow"])
    tracker = Tracker(tracking_uri)  # a new store is created (or upgraded) here, not by two processes at once
    try:
        parent = tracker.find_sweep(sweep)
    except TrackingError:
        if sweep is not None:
            raise
        parent = None
    base = f"http://127.0.0.1:{port}"
    address = base
    if parent is not None:
        address += share_view(tracker, parent.run_id, tracker.trial_records(parent.run_id), parent.objective)
    # One worker process is plenty for one researcher's browser (MLflow's default is four), and
    # MLflow's GenAI job runner (a job process and six task-queue consumers) has nothing to do
    # for training runs.
    command = [
        sys.executable,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        tracking_uri,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    environment = {**os.environ, MLFLOW_JOB_EXECUTION_VARIABLE: "false"}
    # Its chatter goes to standard error: standard output is the address line alone.
    server = subprocess.Popen(command, start_new_session=True, env=environment, stdout=sys.__stderr__)
    stopped = False

    def stop(signum: int = signal.SIGTERM, frame: Any = None) -> None:
        nonlocal stopped
        stopped = True
        stop_process_tree(server.pid)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    try:
        code = wait_until_answering(server, address)
        if code is None:
            on_open(address)
            code = server.wait()
        elif not stopped:
            raise ServerEnded(code, base)
    except KeyboardInterrupt:
        stop()
        server.wait()
        return 0
    except TimeoutError as exc:
        stop()
        raise FoldsweepError(str(exc)) from None
    return 0 if stopped else code


def wait_until_answering(server: subprocess.Popen, url: str, *, deadline_s: float = 120.0) -> int | None:
    """Ask ``url`` until it answers: None once it does, or the server's exit code if it ends first.

    Raises:
        TimeoutError: neither within ``deadline_s``.
    """
    import urllib.error
    import urllib.request

    # Straight to the loopback address, never through an http_proxy of the environment.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with opener.open(url, timeout=5):
                return None
        except urllib.error.HTTPError:  # an answer all the same: what it says is the browser's to show
            return None
        except OSError:  # nothing listens yet, or the server is still starting
            pass
        try:
            return server.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the MLflow UI server did not answer at {url} within {deadline_s:g} s; stopped it"
                ) from None
