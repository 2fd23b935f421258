"""MLflow: the sweep's parent run, a child run per trial, and queries back. The only mlflow importer.

There is a single writer, on the driver: a Ray Tune callback turns trial events into MLflow
calls, so workers never talk to the tracking store.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import urlparse

from ray.tune import Callback

from pipeline.errors import TrackingError

ROLE_TAG = "foldsweep.role"
STATUS_TAG = "foldsweep.status"
SWEEP_TAG = "foldsweep.sweep"
TRIAL_ID_TAG = "foldsweep.trial_id"
ERROR_TAG = "foldsweep.error"
RETRIES_TAG = "foldsweep.retries"
PARENT_TAG = "mlflow.parentRunId"
# Keys of a trial's epoch result that are metrics of the trial (the rest is Ray bookkeeping).
TRIAL_METRIC = re.compile(
    r"^((split\d+|mean|std)_(val|train)_\w+"
    r"|(split\d+_)?(train_samples_per_s|compile_s)|eval_samples_per_s)$")
THROUGHPUT_METRIC = re.compile(r"^(split\d+_)?(train_samples_per_s|compile_s|eval_samples_per_s)$")
# Result fields that say where and how a trial ran, and where it went NaN; recorded as tags
# `foldsweep.<field>`.
RECORDED_FIELDS = ("device", "device_notice", "gpu_ids", "jit_compile", "fused", "fused_reason", "steps_per_launch",
                   "pid", "node_ip", "node_id", "hostname", "data_transfers", "tf_threads", "tensorflow_version",
                   "keras_version", "ray_version", "python_version",
                   "nan_fold", "nan_epoch", "nan_step", "nan_last_finite_loss", "nan_grad_norm")
SCALAR_METRICS = ("n_params", "nan_failures")
HISTORY_ARTIFACT = "history.csv"
TRIAL_CONFIG_ARTIFACT = "trial_config.json"
MAX_TAG_LENGTH = 5000


def check_tracking_uri(uri: str) -> None:
    """Refuse a tracking URI that cannot work, before anything starts.

    Raises:
        TrackingError: unsupported scheme, or a SQLite file whose directory is missing.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        database = _sqlite_path(uri)
        if database is not None and not database.parent.is_dir():
            raise TrackingError(
                f"tracking.uri: the directory of the SQLite file must exist, got {uri!r} "
                f"(no directory {str(database.parent)!r})")
    elif parsed.scheme in ("http", "https"):
        _check_server(uri)
    elif parsed.scheme not in ("file", "postgresql", "mysql", "databricks"):
        raise TrackingError(
            f"tracking.uri must be sqlite:///FILE, http(s)://HOST:PORT or another MLflow store URI, got {uri!r}")


def _check_server(uri: str) -> None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=10) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        raise TrackingError(f"tracking.uri: {uri!r} answered HTTP {exc.code} at /health: is it an MLflow server?") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TrackingError(f"tracking.uri: cannot reach an MLflow server at {uri!r}: {reason}") from None


def _sqlite_path(uri: str) -> Path | None:
    path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None
    if not path or path == ":memory:":
        return None
    return Path(path).resolve()


def _quiet_mlflow() -> None:
    # Artifact downloads (reruns read the spec and config back) would draw progress bars.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # Schema migrations of a new SQLite store log a dozen INFO lines; users need none of them.
    for name in ("alembic", "mlflow.store.db.utils", "mlflow.tracking", "mlflow.store"):
        logging.getLogger(name).setLevel(logging.WARNING)


@dataclass(frozen=True)
class TrialRecord:
    """A trial as MLflow holds it: what the leaderboard and reports read."""

    run_id: str
    run_name: str
    trial_id: str
    state: str
    status: str
    params: Mapping[str, str]
    metrics: Mapping[str, float]
    error: str = ""
    tags: Mapping[str, str] = field(default_factory=dict)


class Tracker:
    """Writes and reads one tracking store."""

    def __init__(self, uri: str):
        _quiet_mlflow()
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)

    def experiment_id(self, name: str) -> str:
        """The MLflow experiment named ``name``, created on first use."""
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        # The MLflow UI opens an experiment on the view its kind names; CV sweeps are model
        # training, not GenAI traces.
        return self.client.create_experiment(name, artifact_location=self._artifact_location(name),
                                             tags={"mlflow.experimentKind": "custom_model_development"})

    def _artifact_location(self, name: str) -> str | None:
        # Artifacts of a SQLite store live beside the database file rather than in whatever
        # directory the command happened to run from.
        database = _sqlite_path(self.uri)
        if database is None:
            return None
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        return (database.parent / "mlartifacts" / safe).as_uri()

    def start_sweep(self, *, name: str, spec_text: str, manifest: Mapping[str, Any],
                    params: Mapping[str, Any]) -> str:
        """Create the parent run of a sweep with its spec and fold manifest; returns its id."""
        from mlflow.entities import Param

        run = self.client.create_run(
            self.experiment_id(name), run_name=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}",
            tags={ROLE_TAG: "sweep", SWEEP_TAG: name, STATUS_TAG: "running"},
        )
        run_id = run.info.run_id
        self.client.log_batch(run_id, params=[Param(key, _param_text(value)) for key, value in params.items()])
        self.client.log_text(run_id, spec_text, "spec.yaml")
        self.client.log_dict(run_id, dict(manifest), "fold_manifest.json")
        return run_id

    def end_sweep(self, run_id: str, *, status: str, summary: Mapping[str, float | str]) -> None:
        for key, value in summary.items():
            if isinstance(value, str):
                self.client.set_tag(run_id, key, value)
            elif math.isfinite(value):
                self.client.log_metric(run_id, key, value)
        self.client.set_tag(run_id, STATUS_TAG, status)
        self.client.set_terminated(run_id, {"ok": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED"))

    def resumable_sweep(self, name: str) -> Any:
        """The latest sweep named ``name``, if it can be resumed (read only).

        Raises:
            TrackingError: no such sweep, or it finished and has nothing to resume.
        """
        parent = self.find_sweep(name)
        status = parent.data.tags.get(STATUS_TAG)
        if status == "ok":
            raise TrackingError(f"--resume: the latest sweep {name!r} (run {parent.info.run_id}) finished; "
                                "nothing to resume (run without --resume for a new sweep)")
        ray_path = parent.data.tags.get("foldsweep.ray_experiment_path")
        if not ray_path:
            raise TrackingError(f"--resume: sweep run {parent.info.run_id} has no Ray experiment path to resume from")
        return parent

    def reopen_sweep(self, parent: Any) -> tuple[str, str]:
        """Set a resumable sweep (``resumable_sweep``) running again: (run id, Ray path)."""
        ray_path = parent.data.tags["foldsweep.ray_experiment_path"]
        self.client.update_run(parent.info.run_id, status="RUNNING")
        self.client.set_tag(parent.info.run_id, STATUS_TAG, "running")
        resumes = int(parent.data.tags.get("foldsweep.resumes", "0")) + 1
        self.client.set_tag(parent.info.run_id, "foldsweep.resumes", str(resumes))
        return parent.info.run_id, ray_path

    def find_trial_run(self, parent_run_id: str, trial_id: str) -> Any:
        """The run already recorded for a Ray trial of this sweep, if any (a resume reuses it)."""
        parent = self.client.get_run(parent_run_id)
        runs = self.client.search_runs(
            [parent.info.experiment_id],
            filter_string=(f"tags.`{PARENT_TAG}` = '{parent_run_id}' and tags.`{ROLE_TAG}` = 'trial' "
                           f"and tags.`{TRIAL_ID_TAG}` = '{trial_id}'"),
            max_results=1)
        return runs[0] if runs else None

    def close_open_trial_runs(self, parent_run_id: str, *, status: str | None) -> None:
        """Trial runs left RUNNING (a stopped sweep, or a driver killed before it closed them)
        end as ``status``; with None, nothing is expected to be open and nothing is done."""
        if status is None:
            return
        for record in self.trial_records(parent_run_id):
            if record.state == "RUNNING":
                self.finish_trial_run(record.run_id, status=status)
    def find_sweep(self, sweep: str | None = None) -> Any:
        """A sweep's parent run: by run id, by sweep (experiment) name, or the latest of all.

        Raises:
            TrackingError: no such sweep in this store.
        """
        from mlflow.exceptions import MlflowException

        role = f"tags.`{ROLE_TAG}` = 'sweep'"
        if sweep is not None and re.fullmatch(r"[0-9a-f]{32}", sweep):
            try:
                run = self.client.get_run(sweep)
            except MlflowException:
                raise TrackingError(f"SWEEP: no run with id {sweep!r} in {self.uri}") from None
            if run.data.tags.get(ROLE_TAG) != "sweep":
                raise TrackingError(f"SWEEP: run {sweep!r} is not a foldsweep sweep (tag {ROLE_TAG}="
                                    f"{run.data.tags.get(ROLE_TAG)!r})")
            return run
        if sweep is not None:
            experiment = self.client.get_experiment_by_name(sweep)
            if experiment is None:
                raise TrackingError(f"SWEEP: no sweep named {sweep!r} in {self.uri}")
            experiment_ids = [experiment.experiment_id]
        else:
            experiment_ids = [e.experiment_id for e in self.client.search_experiments()]
        runs = self.client.search_runs(experiment_ids, filter_string=role, order_by=["attributes.start_time DESC"],
                                       max_results=1) if experiment_ids else []
        if not runs:
            where = f"named {sweep!r} " if sweep else ""
            raise TrackingError(f"SWEEP: no sweep {where}in {self.uri}")
        return runs[0]

    def trial_records(self, parent_run_id: str) -> list[TrialRecord]:
        """Every trial run of a sweep, oldest first."""
        parent = self.client.get_run(parent_run_id)
        runs = self.client.search_runs(
            [parent.info.experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}' and tags.`{ROLE_TAG}` = 'trial'",
            order_by=["attributes.start_time ASC"],
            max_results=50000,
        )
        return [_record(run) for run in runs]

    def start_trial_run(self, *, parent_run_id: str, run_name: str, role: str, config: Mapping[str, Any],
                        tags: Mapping[str, str]) -> str:
        """A child run of the sweep for one trial (or a rerun of one), with the config it uses as
        params and as ``trial_config.json`` (typed, for reruns)."""
        from mlflow.entities import Param

        parent = self.client.get_run(parent_run_id)
        run = self.client.create_run(
            parent.info.experiment_id, run_name=run_name,
            tags={PARENT_TAG: parent_run_id, ROLE_TAG: role, STATUS_TAG: "running", **tags},
        )
        run_id = run.info.run_id
        params = [Param(key, _param_text(value)) for key, value in sorted(config.items()) if value is not None]
        self.client.log_batch(run_id, params=params)
        self.client.log_dict(run_id, dict(config), TRIAL_CONFIG_ARTIFACT)
        return run_id

    def log_trial_result(self, run_id: str, result: Mapping[str, Any], *, step: int) -> None:
        """One epoch's result: metrics at ``step`` = epoch, where-it-ran and NaN tags, summary."""
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        # A fold's NaN is recorded as NaN (it is the finding); a throughput not yet measurable
        # (compilation time before a second epoch) is left out.
        metrics = [
            Metric(key, float(value), now, step)
            for key, value in result.items()
            if TRIAL_METRIC.match(key) and isinstance(value, (int, float))
            and (math.isfinite(value) or not THROUGHPUT_METRIC.match(key))
        ]
        metrics += [Metric(key, float(result[key]), now, step) for key in SCALAR_METRICS if key in result]
        tags = [RunTag(f"foldsweep.{field}", str(result[field])) for field in RECORDED_FIELDS if field in result]
        self.client.log_batch(run_id, metrics=metrics, tags=tags)
        if result.get("model_summary"):
            self.client.log_text(run_id, result["model_summary"], "model_summary.txt")

    def finish_trial_run(self, run_id: str, *, status: str, error: str | None = None,
                         wall_s: float | None = None, tags: Mapping[str, str] | None = None) -> None:
        if wall_s is not None:
            self.client.log_metric(run_id, "trial_wall_s", float(wall_s))
        for key, value in {STATUS_TAG: status, **(tags or {})}.items():
            self.client.set_tag(run_id, key, value)
        if error:
            self.client.set_tag(run_id, ERROR_TAG, error[-MAX_TAG_LENGTH:])
        history = self.history_csv(run_id)
        if history:
            self.client.log_text(run_id, history, HISTORY_ARTIFACT)
        self.client.set_terminated(run_id, STATUS_STATES[status])

    def history_csv(self, run_id: str) -> str:
        """The run's per-epoch metrics as CSV, one row per epoch (what MLflow holds, so a restored
        sweep writes the same file as an uninterrupted one)."""
        import csv
        import io

        run = self.client.get_run(run_id)
        keys = sorted(key for key in run.data.metrics if TRIAL_METRIC.match(key))
        rows: dict[int, dict[str, float]] = {}
        for key in keys:
            for metric in self.client.get_metric_history(run_id, key):
                rows.setdefault(metric.step, {})[key] = metric.value
        if not rows:
            return ""
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=["epoch", *keys])
        writer.writeheader()
        for epoch in sorted(rows):
            writer.writerow({"epoch": epoch, **rows[epoch]})
        return out.getvalue()

    def trial_record(self, run_id: str) -> TrialRecord:
        return _record(self.client.get_run(run_id))

    def callback(self, *, parent_run_id: str, sweep_name: str,
                 on_recorded: Callable[[TrialRecord], None] | None = None,
                 conditions: Mapping[str, Any] | None = None) -> "MlflowTrialCallback":
        return MlflowTrialCallback(self.uri, parent_run_id=parent_run_id, sweep_name=sweep_name,
                                   on_recorded=on_recorded, conditions=conditions)


def _record(run: Any) -> TrialRecord:
    return TrialRecord(
        run_id=run.info.run_id,
        run_name=run.info.run_name,
        trial_id=run.data.tags.get(TRIAL_ID_TAG, ""),
        state=run.info.status,
        status=run.data.tags.get(STATUS_TAG, ""),
        params=dict(run.data.params),
        metrics=dict(run.data.metrics),
        error=run.data.tags.get(ERROR_TAG, ""),
        tags={key.removeprefix("foldsweep."): value for key, value in run.data.tags.items()
              if key.startswith("foldsweep.")},
    )


def _param_text(value: Any) -> str:
    return str(value)[:6000]


def trial_status(result: Mapping[str, Any]) -> str:
    """ok, nan, or pruned (stopped before its planned epochs) from a trial's last result."""
    if result.get("nan_failures", 0) > 0:
        return "nan"
    return "pruned" if result.get("epoch", 0) < result.get("epochs_planned", 0) else "ok"


STATUS_STATES = {"ok": "FINISHED", "pruned": "FINISHED", "nan": "FAILED", "error": "FAILED", "killed": "KILLED"}


class MlflowTrialCallback(Callback):
    """Ray Tune events -> MLflow child runs, written from the driver."""

    def __init__(self, uri: str, *, parent_run_id: str, sweep_name: str,
                 on_recorded: Callable[[TrialRecord], None] | None = None,
                 conditions: Mapping[str, Any] | None = None):
        self.uri = uri
        self.parent_run_id = parent_run_id
        self.sweep_name = sweep_name
        self.on_recorded = on_recorded
        self.conditions = dict(conditions or {})
        self._run_ids: dict[str, str] = {}
        self._retries: dict[str, int] = {}
        self._tracker: Tracker | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Ray pickles callbacks with the experiment state; a live client does not pickle.
        state = dict(self.__dict__)
        state["_tracker"] = None
        state["on_recorded"] = None
        return state

    @property
    def tracker(self) -> Tracker:
        if self._tracker is None:
            self._tracker = Tracker(self.uri)
        return self._tracker

    def run_id(self, trial: Any) -> str | None:
        return self._run_ids.get(trial.trial_id)

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ensure_run(trial)

    def _ensure_run(self, trial: Any) -> str:
        """The trial's child run; created here if Ray reports the trial before it ever started
        (a trial whose worker fails while being set up gets an error but no start event)."""
        from pipeline.space import resolve_config

        if trial.trial_id not in self._run_ids:
            # A resumed sweep continues the run its trial already has: one run per trial.
            existing = self.tracker.find_trial_run(self.parent_run_id, trial.trial_id)
            if existing is not None:
                if existing.info.status != "RUNNING":
                    self.tracker.client.update_run(existing.info.run_id, status="RUNNING")
                    self.tracker.client.set_tag(existing.info.run_id, STATUS_TAG, "running")
                self._run_ids[trial.trial_id] = existing.info.run_id
                return existing.info.run_id
            # The values the trial uses: no threshold without clipping, no inactive conditional hp.
            self._run_ids[trial.trial_id] = self.tracker.start_trial_run(
                parent_run_id=self.parent_run_id, run_name=trial.trial_id, role="trial",
                config=resolve_config(trial.config, self.conditions),
                tags={SWEEP_TAG: self.sweep_name, TRIAL_ID_TAG: trial.trial_id},
            )
        return self._run_ids[trial.trial_id]

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        run_id = self.run_id(trial)
        if run_id is not None:
            self.tracker.log_trial_result(run_id, result, step=int(result.get("training_iteration", 0)))

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._finish(trial, status=trial_status(trial.last_result or {}))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._finish(trial, status="error", error=_error_text(trial))

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        """A worker died and Ray Tune retries the trial (resources.max_failures): count it."""
        run_id = self._ensure_run(trial)
        self._retries[trial.trial_id] = self._retries.get(trial.trial_id, 0) + 1
        self.tracker.client.set_tag(run_id, RETRIES_TAG, str(self._retries[trial.trial_id]))
        self.tracker.client.log_metric(run_id, "retries", float(self._retries[trial.trial_id]))

    def _finish(self, trial: Any, *, status: str, error: str | None = None) -> None:
        run_id = self._ensure_run(trial)
        del self._run_ids[trial.trial_id]
        self.tracker.finish_trial_run(run_id, status=status, error=error,
                                      wall_s=(trial.last_result or {}).get("time_total_s"))
        if self.on_recorded is not None:
            self.on_recorded(self.tracker.trial_record(run_id))


def _error_text(trial: Any) -> str:
    error_file = getattr(trial, "error_file", None)
    if error_file and Path(error_file).is_file():
        return Path(error_file).read_text(errors="replace").strip()
    return str(getattr(trial, "error_msg", "") or "unknown error")
