"""MLflow: the sweep's parent run, a child run per trial, and queries back, typed. With
``stores`` (which checks and opens a store), the only module that holds an MLflow client;
everything else speaks to the store through ``Tracker``.

There is a single writer, on the driver: a Ray Tune callback (``pipeline.records.callbacks``)
turns trial events into ``TrialRecorder`` calls, so workers never talk to the tracking store.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.base.errors import TrackingError
from pipeline.base.mlflow_private import MLFLOW_SHARED_VIEW_PARAM, MLFLOW_SHARED_VIEW_TAG
from pipeline.contract.results import (
    BEST_EPOCH,
    EPOCH_GAP_S,
    FOLD_IDS,
    NAN_FAILURES,
    PLAN_ARTIFACT,
    RETRIES,
    SELECTED_PREFIX,
    EpochResult,
    EpochSelection,
    SweepStatus,
    TrialInfo,
    TrialStatus,
    in_history,
    placement_metrics,
    placement_tags,
    trial_label,
)
from pipeline.inputs.scoring import Direction
from pipeline.inputs.spec import Objective
from pipeline.records.chart_view import chart_view
from pipeline.records.provenance import TRAINING, DataInput
from pipeline.records.stores import empty_store, quiet_mlflow, ready_store, sqlite_path, start_from_empty_store


class Tag:
    """The tag names foldsweep writes: its own under ``foldsweep.``, MLflow's where it has one."""

    PREFIX = "foldsweep."
    ROLE = "foldsweep.role"
    STATUS = "foldsweep.status"
    SWEEP = "foldsweep.sweep"
    CODE = "foldsweep.code"
    TRIAL_ID = "foldsweep.trial_id"
    ERROR = "foldsweep.error"
    RETRIES = "foldsweep.retries"
    RERUN_OF = "foldsweep.rerun_of"
    RAY_PATH = "foldsweep.ray_experiment_path"
    RESUMES = "foldsweep.resumes"
    BEST_RUN_ID = "foldsweep.best_run_id"
    REFIT = "foldsweep.refit"
    REFIT_OF = "foldsweep.refit_of"
    REFIT_MODEL = "foldsweep.refit_model"
    REGISTERED_MODEL = "foldsweep.registered_model"
    NUMERICS_OP = "foldsweep.numerics_op"
    NUMERICS_NODE = "foldsweep.numerics_node"
    NUMERICS_LAYER = "foldsweep.numerics_layer"
    NUMERICS_VARIABLE = "foldsweep.numerics_variable"
    NUMERICS_FOLD = "foldsweep.numerics_fold"
    NUMERICS_EPOCH = "foldsweep.numerics_epoch"
    NUMERICS_STEP = "foldsweep.numerics_step"
    RERUN_DIFFERS = "foldsweep.rerun_differs"
    PVALUE_VS_BEST = "foldsweep.pvalue_vs_best"
    PARENT = "mlflow.parentRunId"

    @classmethod
    def of(cls, field: str) -> str:
        """The tag of a recorded result field (``device`` -> ``foldsweep.device``)."""
        return f"{cls.PREFIX}{field}"


HISTORY_ARTIFACT = "history.csv"
TRIAL_CONFIG_ARTIFACT = "trial_config.json"
SPEC_ARTIFACT = "spec.yaml"
MANIFEST_ARTIFACT = "fold_manifest.json"
MAX_TAG_LENGTH = 5000
MAX_EXPERIMENT_TAG_LENGTH = 20000  # what MLflow keeps of an experiment tag's value
# What the MLflow UI shows as a run's description, and the experiment tags its shared views use.
DESCRIPTION_TAG = "mlflow.note.content"
# Where MLflow's own functions (``mlflow.pyfunc.load_model("models:/...")``) find the store.
TRACKING_URI_VARIABLE = "MLFLOW_TRACKING_URI"


@dataclass(frozen=True)
class TrialRecord:
    """A trial as MLflow holds it: what the leaderboard and reports read."""

    run_id: str
    run_name: str
    trial_id: str
    state: str  # the MLflow run state
    status: TrialStatus | None  # None for a run that has not ended
    params: Mapping[str, str]
    metrics: Mapping[str, float]
    error: str = ""
    tags: Mapping[str, str] = field(default_factory=dict)  # by full name, as ``Tag`` spells them
    ended_at: float | None = None  # when its run ended (seconds since the epoch); None while open
    started_at: float | None = None  # when its run started (seconds since the epoch)

    @property
    def label(self) -> str:
        """``trial-00003``: the trial's number in its sweep (its run name also names its values)."""
        return trial_label(self.trial_id) if self.trial_id else self.run_name

    @classmethod
    def from_run(cls, run: Any) -> TrialRecord:
        """The record of an MLflow run (the one place a trial's flat record is read back)."""
        tags = run.data.tags
        return cls(
            run_id=run.info.run_id,
            run_name=run.info.run_name,
            trial_id=tags.get(Tag.TRIAL_ID, ""),
            state=run.info.status,
            status=_trial_status(run.info.status, tags.get(Tag.STATUS)),
            params=dict(run.data.params),
            metrics=dict(run.data.metrics),
            error=tags.get(Tag.ERROR, ""),
            tags=dict(tags),
            ended_at=run.info.end_time / 1000 if run.info.end_time else None,
            started_at=run.info.start_time / 1000 if run.info.start_time else None,
        )


def _trial_status(run_state: str, tag: str | None) -> TrialStatus | None:
    """A trial's status as its record holds it. A trial's status is written first as it ends, its
    run's end last (``TrialRecorder.finish``): a run still running under an ended status is one
    whose driver was killed in between, a trial that has not ended (a resume trains it on)."""
    status = TrialStatus.recorded(tag)
    return TrialStatus.RUNNING if status is not None and run_state == TrialStatus.RUNNING.run_state else status


@dataclass(frozen=True)
class SweepRecord:
    """A sweep's parent run as MLflow holds it."""

    run_id: str
    name: str
    params: Mapping[str, str]
    metrics: Mapping[str, float]
    tags: Mapping[str, str]
    state: str = ""  # the MLflow run state

    @property
    def objective(self) -> Objective:
        mode: Direction = "max" if self.params.get("train.mode", "max") == "max" else "min"
        return Objective(metric=self.params.get("train.metric", "accuracy"), mode=mode)

    @property
    def n_splits(self) -> int | None:
        """Folds per repeat of the sweep's CV."""
        return int(self.params["cv.n_splits"]) if "cv.n_splits" in self.params else None

    @classmethod
    def from_run(cls, run: Any) -> SweepRecord:
        return cls(
            run_id=run.info.run_id,
            name=run.data.tags.get(Tag.SWEEP, run.info.run_name),
            params=dict(run.data.params),
            metrics=dict(run.data.metrics),
            tags=dict(run.data.tags),
            state=run.info.status,
        )


@dataclass(frozen=True)
class RecordedTrialRun:
    """What a rerun reads of a recorded trial: its config and its sweep's spec and folds."""

    run_id: str
    run_name: str
    parent_run_id: str
    config: dict[str, Any]
    spec_text: str
    manifest: dict[str, Any]
    sweep_params: Mapping[str, str]
    sweep_tags: Mapping[str, str]
    plan: dict[str, Any] | None  # trial_plan.json; None for trials recorded before plans were


def load_tracking_modules() -> None:
    """Import what opening a store takes, MLflow's client and its SQLAlchemy store (~1 s of
    imports), opening and writing nothing: a sweep's driver loads them while it waits for Ray."""
    quiet_mlflow()
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
    from mlflow.tracking import MlflowClient  # noqa: F401


def make_empty_store() -> Path | None:
    """This environment's empty store in foldsweep's cache (``empty_store``), made now where the
    cache has none; None where none can be made. ``make install`` runs it (``python -m
    pipeline.records.tracking``), so that a fresh clone's first sweep copies the empty store
    rather than waiting, as it starts, for MLflow's migrations of its new store."""
    quiet_mlflow()
    return empty_store(_birth_client)


def _birth_client(location: str) -> Any:
    """A plain MLflow client of the store at ``location``, which makes the store's tables as it
    opens it (a store's birth: MLflow's schema, nothing of foldsweep's)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=location)


class Tracker:
    """Writes and reads one tracking store: the only holder of an MLflow client."""

    def __init__(self, uri: str):
        quiet_mlflow()
        from mlflow.tracking import MlflowClient

        self.uri = uri
        start_from_empty_store(uri, _birth_client)
        # The store's own model registry, whatever MLFLOW_REGISTRY_URI says.
        self._client = ready_store(lambda: MlflowClient(tracking_uri=uri, registry_uri=uri), uri)
        self._monitors: dict[str, Any] = {}  # run id -> MLflow's system metrics monitor on it

    def experiment_id(self, name: str) -> str:
        """The MLflow experiment named ``name``, created on first use."""
        experiment = self._client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        # The MLflow UI opens an experiment on the view its kind names; CV sweeps are model
        # training, not GenAI traces.
        return self._client.create_experiment(
            name,
            artifact_location=self._artifact_location(name),
            tags={"mlflow.experimentKind": "custom_model_development"},
        )

    def _artifact_location(self, name: str) -> str | None:
        # Artifacts of a SQLite store live beside the database file rather than in whatever
        # directory the command happened to run from.
        database = sqlite_path(self.uri)
        if database is None:
            return None
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        return (database.parent / "mlartifacts" / safe).as_uri()

    # -- sweeps ---------------------------------------------------------------------------------

    def start_sweep(
        self,
        *,
        name: str,
        spec_text: str,
        manifest: Mapping[str, Any],
        params: Mapping[str, Any],
        ray_path_for: Callable[[str], str],
        tags: Mapping[str, str] = {},
        data: Sequence[DataInput] = (),
        code: Sequence[Path] = (),
    ) -> tuple[str, str]:
        """Create the parent run of a sweep with its spec, fold manifest, ``tags``, ``data`` (its
        splits as dataset inputs) and ``code`` (the experiment's files, ``experiment_code``);
        returns its id and the Ray Tune experiment path (``ray_path_for(run_id)``), recorded for a
        resume."""
        from mlflow.entities import Param, RunTag

        from pipeline.records.experiment_code import CODE_ARTIFACT, code_tag

        run = self._client.create_run(
            self.experiment_id(name),
            run_name=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}",
            tags={
                **tags,
                Tag.ROLE: "sweep",
                Tag.SWEEP: name,
                Tag.STATUS: SweepStatus.RUNNING.value,
                **({Tag.CODE: code_tag(code)} if code else {}),
            },
        )
        run_id = run.info.run_id
        ray_path = ray_path_for(run_id)
        self._client.log_batch(
            run_id,
            params=[Param(key, _param_text(value)) for key, value in params.items()],
            tags=[RunTag(Tag.RAY_PATH, ray_path)],
        )
        self.log_data(run_id, data)
        self._client.log_text(run_id, spec_text, SPEC_ARTIFACT)
        self._client.log_dict(run_id, dict(manifest), MANIFEST_ARTIFACT)
        for file in code:
            self._client.log_artifact(run_id, str(file), CODE_ARTIFACT)
        return run_id, ray_path

    def recorded_code(self, parent_run_id: str, destination: Path) -> Path:
        """The experiment's files as the sweep ``parent_run_id`` recorded them (``start_sweep``'s
        ``code``), downloaded into ``destination``; returns their directory."""
        from pipeline.records.experiment_code import CODE_ARTIFACT

        return Path(self._client.download_artifacts(parent_run_id, CODE_ARTIFACT, str(destination)))

    def monitor_system(self, run_id: str) -> None:
        """MLflow's system metrics (``system/...``: CPU, memory, disk, network, and GPU where
        its library is installed) sampled on the run until ``end_sweep`` closes it."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, resume_logging=True, tracking_uri=self.uri)
        monitor.start()
        self._monitors[run_id] = monitor

    def end_sweep(self, run_id: str, *, status: SweepStatus, summary: Mapping[str, float | str]) -> None:
        """Close a sweep's parent run: its system metrics' last sample, summary metrics (finite
        ones) and tags, status, run state."""
        from mlflow.entities import Metric, RunTag

        monitor = self._monitors.pop(run_id, None)
        if monitor is not None:
            monitor.finish()

        now = int(time.time() * 1000)
        self._client.log_batch(
            run_id,
            metrics=[
                Metric(key, value, now, 0)
                for key, value in summary.items()
                if not isinstance(value, str) and math.isfinite(value)
            ],
            tags=[
                *(RunTag(key, value) for key, value in summary.items() if isinstance(value, str)),
                RunTag(Tag.STATUS, status.value),
            ],
        )
        self._client.set_terminated(run_id, status.run_state)

    def resumable_sweep(self, name: str) -> SweepRecord:
        """The latest sweep named ``name``, if it can be resumed (read only).

        Raises:
            TrackingError: no such sweep, or it finished and has nothing to resume.
        """
        parent = self.find_sweep(name)
        if parent.tags.get(Tag.STATUS) == SweepStatus.OK.value:
            raise TrackingError(
                f"--resume: the latest sweep {name!r} (run {parent.run_id}) finished; "
                "nothing to resume (run without --resume for a new sweep)"
            )
        if not parent.tags.get(Tag.RAY_PATH):
            raise TrackingError(f"--resume: sweep run {parent.run_id} has no Ray experiment path to resume from")
        return parent

    def reopen_sweep(self, parent: SweepRecord, ray_path: str) -> tuple[str, str]:
        """Set a resumable sweep (``resumable_sweep``) running again from Ray Tune's state at
        ``ray_path`` (recorded, for a later resume): (run id, Ray path)."""
        resumes = int(parent.tags.get(Tag.RESUMES, "0")) + 1
        self._client.update_run(parent.run_id, status="RUNNING")
        self.tag_runs(
            {
                parent.run_id: {
                    Tag.STATUS: SweepStatus.RUNNING.value,
                    Tag.RESUMES: str(resumes),
                    Tag.RAY_PATH: ray_path,
                }
            }
        )
        return parent.run_id, ray_path

    def find_sweep(self, sweep: str | None = None) -> SweepRecord:
        """A sweep's parent run: by run id, by sweep (experiment) name, or the latest of all.

        Raises:
            TrackingError: no such sweep in this store.
        """
        from mlflow.exceptions import MlflowException

        if sweep is not None and re.fullmatch(r"[0-9a-f]{32}", sweep):
            try:
                run = self._client.get_run(sweep)
            except MlflowException:
                raise TrackingError(f"SWEEP: no run with id {sweep!r} in {self.uri}") from None
            if run.data.tags.get(Tag.ROLE) != "sweep":
                raise TrackingError(
                    f"SWEEP: run {sweep!r} is not a foldsweep sweep (tag {Tag.ROLE}={run.data.tags.get(Tag.ROLE)!r})"
                )
            return SweepRecord.from_run(run)
        if sweep is not None:
            experiment = self._client.get_experiment_by_name(sweep)
            if experiment is None and re.fullmatch(r"[0-9a-f]{4,31}", sweep):
                return self._sweep_by_run_id_start(sweep)
            if experiment is None:
                raise TrackingError(f"SWEEP: no sweep named {sweep!r} in {self.uri}")
            experiment_ids = [experiment.experiment_id]
        else:
            experiment_ids = [e.experiment_id for e in self._client.search_experiments()]
        runs = self._sweep_runs(experiment_ids, max_results=1)
        if not runs:
            where = f"named {sweep!r} " if sweep else ""
            raise TrackingError(f"SWEEP: no sweep {where}in {self.uri}")
        return SweepRecord.from_run(runs[0])

    def _sweep_by_run_id_start(self, start: str) -> SweepRecord:
        """The sweep whose parent run id starts with ``start`` (the short id ``run`` prints).

        Raises:
            TrackingError: no sweep, or more than one, has such a run id.
        """
        experiment_ids = [e.experiment_id for e in self._client.search_experiments()]
        runs = self._sweep_runs(experiment_ids) if experiment_ids else []
        matching = [run for run in runs if run.info.run_id.startswith(start)]
        if len(matching) == 1:
            return SweepRecord.from_run(matching[0])
        if not matching:
            raise TrackingError(f"SWEEP: no sweep named {start!r}, nor with a run id starting so, in {self.uri}")
        shown = ", ".join(run.info.run_id for run in matching[:5])
        raise TrackingError(f"SWEEP: {start!r} starts the run ids of {len(matching)} sweeps: {shown}; give more of it")

    def sweep_records(self, name: str) -> list[SweepRecord]:
        """Every sweep recorded under the name ``name``, newest first; none while there is none."""
        experiment = self._client.get_experiment_by_name(name)
        runs = self._sweep_runs([experiment.experiment_id]) if experiment is not None else []
        return [SweepRecord.from_run(run) for run in runs]

    def _sweep_runs(self, experiment_ids: Sequence[str], *, max_results: int = 50000) -> list[Any]:
        """The sweeps' parent runs in ``experiment_ids``, newest first."""
        if not experiment_ids:
            return []
        return self._client.search_runs(
            list(experiment_ids),
            filter_string=f"tags.`{Tag.ROLE}` = 'sweep'",
            order_by=["attributes.start_time DESC"],
            max_results=max_results,
        )

    def publish_sweep_files(
        self, run_id: str, *, texts: Mapping[str, str] = {}, files: Mapping[Path, str | None] = {}
    ) -> None:
        """Artifacts of a sweep's parent run: ``texts`` {artifact path: content}, ``files``
        {local file: artifact directory (None: the top)}."""
        for artifact, text in texts.items():
            self._client.log_text(run_id, text, artifact)
        for path, directory in files.items():
            self._client.log_artifact(run_id, str(path), directory)

    def log_data(self, run_id: str, data: Sequence[DataInput]) -> None:
        """The data a run saw, as MLflow dataset inputs, in one write."""
        if data:
            self._client.log_inputs(run_id, datasets=[item.entity() for item in data])

    def log_model(
        self,
        run_id: str,
        directory: Path,
        *,
        name: str,
        params: Mapping[str, Any],
        tags: Mapping[str, str],
        scores: Mapping[str, float],
        scored_on: DataInput | None,
    ) -> str:
        """An MLflow Model directory (``pipeline.records.model_package``) as a logged model of the
        run ``run_id`` (its output, as ``mlflow.<flavor>.log_model`` links one), with ``params``,
        ``tags`` and ``scores`` on ``scored_on`` logged against it (and on the run); returns its
        ``models:/`` URI. The run stays as it is (open or closed)."""
        from mlflow.entities import LoggedModelOutput, LoggedModelStatus, Metric
        from mlflow.models import Model

        run = self._client.get_run(run_id)
        model = self._client.create_logged_model(
            run.info.experiment_id,
            name=name,
            source_run_id=run_id,
            params={key: _param_text(value) for key, value in params.items() if value is not None},
            tags=dict(tags),
        )
        try:
            described = Model.load(str(directory))
            described.run_id, described.model_id, described.model_uuid = run_id, model.model_id, model.model_id
            described.artifact_path = model.artifact_location
            described.save(str(directory / "MLmodel"))
            self._client.log_model_artifacts(model.model_id, str(directory))
        except BaseException:
            self._client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
            raise
        self._client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        self._client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
        now = int(time.time() * 1000)
        dataset = {"dataset_name": scored_on.name, "dataset_digest": scored_on.digest} if scored_on else {}
        self._client.log_batch(
            run_id,
            metrics=[
                Metric(key, value, now, 0, model_id=model.model_id, run_id=run_id, **dataset)
                for key, value in scores.items()
            ],
        )
        return f"models:/{model.model_id}"

    def register_model(self, model_uri: str, *, name: str, alias: str | None = None) -> str:
        """A new version of the registered model ``name`` (created on first use) from the logged
        model ``model_uri``, with ``alias`` moved to it when given; returns the version. As
        ``mlflow.register_model`` registers one: its source is the model's URI, and the model's
        ``mlflow.modelVersions`` tag names its versions (what the UI links)."""
        from mlflow.exceptions import MlflowException
        from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

        try:
            self._client.get_registered_model(name)
        except MlflowException:
            self._client.create_registered_model(name)
        model_id = model_uri.removeprefix("models:/")
        # MLflow's registry resolves a models:/ source through the process's tracking URI.
        with _tracking_uri_variable(self.uri):
            version = self._client.create_model_version(name, model_uri, model_id=model_id)
        if alias is not None:
            self._client.set_registered_model_alias(name, alias, version.version)
        # A tracking server adds the version itself; a SQLite store leaves it to the client.
        versions = json.loads(self._client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS, "[]"))
        this = {"name": name, "version": int(version.version)}
        if this not in versions:
            self._client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps([*versions, this])})
        return str(version.version)

    def tag_runs(self, tags: Mapping[str, Mapping[str, str]]) -> None:
        """Tags of several runs, {run id: {tag: value}}: one write per run."""
        from mlflow.entities import RunTag

        for run_id, values in tags.items():
            if values:
                self._client.log_batch(run_id, tags=[RunTag(key, value) for key, value in values.items()])

    def share_sweep_view(
        self,
        parent_run_id: str,
        *,
        objective: Objective,
        columns: Sequence[str] = (),
        metric_keys: Iterable[str] = (),
    ) -> str:
        """A view of a sweep's trials that the MLflow UI opens from a link: the trials listed flat,
        best first by the objective at each trial's selected epoch, with it, its spread, that
        epoch, the p-value against the best, the status, ``columns`` (params) and the dataset
        shown; its chart view laid out over the trials' ``metric_keys`` (``chart_view``), every
        trial plotted. Stored as the experiment's shared view state (what the UI's own "share"
        writes); returns the UI address path that opens it."""
        parent = self._client.get_run(parent_run_id)
        experiment_id = parent.info.experiment_id
        key = f"foldsweep-{parent_run_id[:12]}"
        shown = [
            f"metrics.`{SELECTED_PREFIX}{objective.key}`",
            f"metrics.`{SELECTED_PREFIX}{objective.spread_key}`",
            f"metrics.`{BEST_EPOCH}`",
            f"tags.`{Tag.PVALUE_VS_BEST}`",
            f"tags.`{Tag.STATUS}`",
            *(f"params.`{name}`" for name in columns),
            "attributes.`Dataset`",  # the data each trial trained on (the UI's own column)
        ]
        table = {
            "searchFilter": f"tags.`{Tag.PARENT}` = '{parent_run_id}' and tags.`{Tag.ROLE}` = 'trial'",
            "orderByKey": f"metrics.`{SELECTED_PREFIX}{objective.key}`",
            "orderByAsc": objective.mode == "min",
            "selectedColumns": shown,
            # In this order, the scores first: the UI puts its own columns (the dataset) before them.
            "columnOrder": shown,
        }
        # The charts have what MLflow keeps of an experiment tag's value, less the table's (and a margin).
        budget = MAX_EXPERIMENT_TAG_LENGTH - len(json.dumps(table)) - 500
        state = {**table, **chart_view(objective, metric_keys, columns, budget=budget)}
        self._client.set_experiment_tag(experiment_id, f"{MLFLOW_SHARED_VIEW_TAG}{key}", json.dumps(state))
        return f"/#/experiments/{experiment_id}/runs?{MLFLOW_SHARED_VIEW_PARAM}={key}&workflowType=machine_learning"

    def metric_histories(self, run_ids: Sequence[str], key: str) -> dict[str, list[tuple[int, float]]]:
        """One metric's (step, value) history of each run."""
        return {
            run_id: [(metric.step, metric.value) for metric in self._client.get_metric_history(run_id, key)]
            for run_id in run_ids
        }

    # -- trials ---------------------------------------------------------------------------------

    def trial_records(self, parent_run_id: str) -> list[TrialRecord]:
        """Every trial run of a sweep, oldest first."""
        parent = self._client.get_run(parent_run_id)
        runs = self._client.search_runs(
            [parent.info.experiment_id],
            filter_string=f"tags.`{Tag.PARENT}` = '{parent_run_id}' and tags.`{Tag.ROLE}` = 'trial'",
            order_by=["attributes.start_time ASC"],
            max_results=50000,
        )
        return [TrialRecord.from_run(run) for run in runs]

    def trial_record(self, run_id: str) -> TrialRecord:
        return TrialRecord.from_run(self._client.get_run(run_id))

    def reruns(self, run_id: str) -> list[TrialRecord]:
        """The runs `foldsweep rerun` recorded of the trial run ``run_id``, newest first."""
        runs = self._client.search_runs(
            [self._client.get_run(run_id).info.experiment_id],
            filter_string=f"tags.`{Tag.RERUN_OF}` = '{run_id}'",
            order_by=["attributes.start_time DESC"],
            max_results=50000,
        )
        return [TrialRecord.from_run(run) for run in runs]

    def artifact_paths(self, run_id: str, directory: str | None = None) -> list[str]:
        """The paths of a run's artifacts in ``directory`` (None: the top)."""
        return [item.path for item in self._client.list_artifacts(run_id, directory)]

    def missing_artifacts(self, run_id: str) -> str | None:
        """Why the run's artifacts cannot be read or written: a local artifact folder, recorded
        absolute, that is not there (a store moved without it, or away from where it was
        recorded); None where it is, or is not local."""
        from urllib.parse import urlparse

        root = self._client.get_run(run_id).info.artifact_uri
        parsed = urlparse(root)
        if parsed.scheme not in ("", "file") or Path(parsed.path).is_dir():
            return None
        return (
            f"the artifacts of run {run_id} are recorded at {root}, which does not exist: MLflow records their place "
            "absolute, so a store moved from where it recorded them (its mlartifacts folder with it) no longer finds "
            "them; put the store back where it was, or keep it there"
        )

    def artifact_file(self, run_id: str, path: str, directory: Path) -> Path:
        """A run's artifact ``path``, downloaded into the local ``directory``."""
        return Path(self._client.download_artifacts(run_id, path, str(directory)))

    def close_open_trial_runs(
        self, parent_run_id: str, *, status: TrialStatus, selection: EpochSelection | None = None
    ) -> None:
        """Trial runs left RUNNING (a stopped sweep, or a driver killed before it closed them)
        end as ``status``."""
        for record in self.trial_records(parent_run_id):
            if record.state == "RUNNING":
                TrialRecorder(self, record.run_id, selection).finish(status)

    def trial_recorder(
        self,
        *,
        parent_run_id: str,
        run_name: str,
        role: str,
        config: Mapping[str, Any],
        tags: Mapping[str, str],
        trial_id: str | None = None,
        selection: EpochSelection | None = None,
        data: Sequence[DataInput] = (),
    ) -> TrialRecorder:
        """The recorder of a trial's run (or a rerun's): a new child run of the sweep with the
        config it uses as params and as ``trial_config.json`` (typed, for reruns), and the data
        it trains on (``data``'s training split) as its dataset input; for a Ray trial that
        already has a run in this sweep (a resume), that run, set running again."""
        from mlflow.entities import Param

        if trial_id is not None:
            existing = self._find_trial_run(parent_run_id, trial_id)
            if existing is not None:
                if existing.info.status != "RUNNING":
                    self._client.update_run(existing.info.run_id, status="RUNNING")
                    self._client.set_tag(existing.info.run_id, Tag.STATUS, TrialStatus.RUNNING.value)
                reopened = TrialRecorder(self, existing.info.run_id, selection)
                reopened.recorded_epochs = reopened.epochs_in_record()
                return reopened
            tags = {**tags, Tag.TRIAL_ID: trial_id}
        parent = self._client.get_run(parent_run_id)
        run = self._client.create_run(
            parent.info.experiment_id,
            run_name=run_name,
            tags={Tag.PARENT: parent_run_id, Tag.ROLE: role, Tag.STATUS: TrialStatus.RUNNING.value, **tags},
        )
        run_id = run.info.run_id
        params = [Param(key, _param_text(value)) for key, value in sorted(config.items()) if value is not None]
        self._client.log_batch(run_id, params=params)
        self._client.log_dict(run_id, dict(config), TRIAL_CONFIG_ARTIFACT)
        self.log_data(run_id, [item for item in data if item.context == TRAINING])
        return TrialRecorder(self, run_id, selection)

    def _find_trial_run(self, parent_run_id: str, trial_id: str) -> Any:
        parent = self._client.get_run(parent_run_id)
        runs = self._client.search_runs(
            [parent.info.experiment_id],
            filter_string=(
                f"tags.`{Tag.PARENT}` = '{parent_run_id}' and tags.`{Tag.ROLE}` = 'trial' "
                f"and tags.`{Tag.TRIAL_ID}` = '{trial_id}'"
            ),
            max_results=1,
        )
        return runs[0] if runs else None

    def _not_a_trial(self, given: str) -> str:
        """What the run ``given`` names is, where it is a run of this store but no trial's."""
        from mlflow.exceptions import MlflowException

        experiments = [experiment.experiment_id for experiment in self._client.search_experiments()]
        try:
            runs = self._client.search_runs(experiments, max_results=50000) if experiments and given.strip() else []
        except MlflowException:
            return ""
        matching = [run for run in runs if run.info.run_id.startswith(given.lower())]
        if len(matching) != 1:
            return ""
        role = matching[0].data.tags.get(Tag.ROLE)
        if role == "sweep":
            return f": it is the run of sweep {matching[0].info.run_name!r}, whose trials the leaderboard lists"
        if matching[0].data.tags.get(Tag.RERUN_OF):
            return f": it is a rerun of trial run {matching[0].data.tags[Tag.RERUN_OF]!r}"
        return f": it is run {matching[0].info.run_name!r}, not a trial's"

    def trial_run_id(self, given: str) -> str:
        """The full run id of what a user gave for a trial: its run id, the start of it that the
        leaderboard shows, or Ray Tune's trial id (``11830_00000``).

        Raises:
            TrackingError: nothing, or more than one trial, matches.
        """
        from mlflow.exceptions import MlflowException

        with contextlib.suppress(MlflowException):
            return self._client.get_run(given).info.run_id
        experiments = [experiment.experiment_id for experiment in self._client.search_experiments()]
        runs = (
            self._client.search_runs(experiments, filter_string=f"tags.`{Tag.ROLE}` = 'trial'", max_results=50000)
            if experiments and given.strip()
            else []
        )
        matching = [run for run in runs if run.data.tags.get(Tag.TRIAL_ID) == given]
        matching = matching or [run for run in runs if run.info.run_id.startswith(given.lower())]
        if len(matching) == 1:
            return matching[0].info.run_id
        if not matching:
            raise TrackingError(
                f"RUN_ID: no trial run with id {given!r} in {self.uri}{self._not_a_trial(given)} (give an MLflow run "
                "id, the start of one as the leaderboard shows it, or a Ray trial id)"
            )
        shown = ", ".join(f"{run.info.run_id} ({run.info.run_name})" for run in matching[:5])
        raise TrackingError(
            f"RUN_ID: {given!r} matches {len(matching)} trial runs in {self.uri}: {shown}; give more of the run id"
        )

    def recorded_trial_run(self, run_id: str) -> RecordedTrialRun:
        """A trial's config, and its sweep's spec text, fold manifest and params.

        Raises:
            TrackingError: unknown run id, or a run that is not a foldsweep trial.
        """
        import tempfile

        from mlflow.exceptions import MlflowException

        run_id = self.trial_run_id(run_id)
        run = self._client.get_run(run_id)
        if run.data.tags.get(Tag.ROLE) not in ("trial", "rerun"):
            raise TrackingError(
                f"RUN_ID: run {run_id!r} is not a foldsweep trial (tag {Tag.ROLE}={run.data.tags.get(Tag.ROLE)!r})"
            )
        parent_id = run.data.tags[Tag.PARENT]
        with tempfile.TemporaryDirectory() as directory:

            def text(of_run: str, artifact: str) -> str:
                try:
                    return self.artifact_file(of_run, artifact, Path(directory)).read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError, MlflowException) as exc:
                    why = self.missing_artifacts(of_run) or str(exc)
                    raise TrackingError(f"RUN_ID: cannot read {artifact} of run {of_run}: {why}") from None

            def document(of_run: str, artifact: str) -> Any:
                try:
                    return json.loads(text(of_run, artifact))
                except json.JSONDecodeError as exc:
                    raise TrackingError(f"RUN_ID: {artifact} of run {of_run} is damaged (not JSON: {exc})") from None

            config = document(run_id, TRIAL_CONFIG_ARTIFACT)
            spec_text = text(parent_id, SPEC_ARTIFACT)
            manifest = document(parent_id, MANIFEST_ARTIFACT)
            plan = document(run_id, PLAN_ARTIFACT) if PLAN_ARTIFACT in self.artifact_paths(run_id) else None
        parent = self._client.get_run(parent_id)
        return RecordedTrialRun(
            run_id=run_id,
            run_name=run.info.run_name,
            parent_run_id=parent_id,
            config=config,
            spec_text=spec_text,
            manifest=manifest,
            sweep_params=dict(parent.data.params),
            sweep_tags=dict(parent.data.tags),
            plan=plan,
        )

    def epoch_rows(self, run_id: str) -> dict[int, dict[str, float]]:
        """The run's per-epoch metrics, {epoch: {key: value}} (what MLflow holds, so a restored
        sweep reads the same as an uninterrupted one)."""
        run = self._client.get_run(run_id)
        rows: dict[int, dict[str, float]] = {}
        for key in sorted(key for key in run.data.metrics if in_history(key)):
            for metric in self._client.get_metric_history(run_id, key):
                rows.setdefault(metric.step, {})[key] = metric.value
        return rows


class TrialRecorder:
    """One trial run's life in MLflow: its epochs as they come, then its end. Serves the Ray
    callback and in-process trials (``foldsweep trial``/``rerun``) alike. With a ``selection``,
    the end records the epoch the trial is scored at and its scores there."""

    def __init__(
        self,
        tracker: Tracker,
        run_id: str,
        selection: EpochSelection | None = None,
        *,
        recorded_epochs: frozenset[int] = frozenset(),
    ):
        self.tracker = tracker
        self.run_id = run_id
        self.selection = selection
        # Epochs a resumed trial's run holds already: a trial restored from a checkpoint older
        # than its last recorded epoch (a driver killed between the two) trains those again,
        # and each epoch stays recorded once.
        self.recorded_epochs = recorded_epochs

    @property
    def _client(self) -> Any:
        return self.tracker._client

    def epochs_in_record(self) -> frozenset[int]:
        """The epochs the run holds (every epoch records its NaN count)."""
        return frozenset(metric.step for metric in self._client.get_metric_history(self.run_id, NAN_FAILURES))

    def log_epoch(self, report: Mapping[str, Any]) -> None:
        """One epoch's report (``EpochResult.report``): metrics at step = epoch; where and how it
        ran as tags, the model summary and the plan as artifacts, when the report has them."""
        from mlflow.entities import Metric, Param, RunTag

        result = EpochResult.from_report(report)
        info = TrialInfo.from_report(report)
        now = int(time.time() * 1000)
        metrics = {**result.mlflow_metrics(), **placement_metrics(report), **(info.mlflow_metrics() if info else {})}
        if result.epoch in self.recorded_epochs:
            metrics = {}
        tags = {**(info.mlflow_tags() if info else {}), **placement_tags(report), **result.mlflow_tags()}
        params = info.mlflow_params() if info else {}
        if params:  # what the trial's config did not hold already (MLflow params never change)
            recorded = self._client.get_run(self.run_id).data.params
            params = {key: value for key, value in params.items() if key not in recorded}
        self._client.log_batch(
            self.run_id,
            metrics=[Metric(key, value, now, result.epoch) for key, value in metrics.items()],
            params=[Param(key, value) for key, value in params.items()],
            tags=[RunTag(Tag.of(key), value) for key, value in tags.items()],
        )
        for artifact, text in (info.mlflow_texts() if info else {}).items():
            self._client.log_text(self.run_id, text, artifact)

    def log_directory(self, directory: Path, artifact_path: str) -> None:
        """A directory's files as the run's artifacts under ``artifact_path`` (a profile's trace)."""
        self._client.log_artifacts(self.run_id, str(directory), artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.tracker.tag_runs({self.run_id: {key: value[:MAX_TAG_LENGTH] for key, value in tags.items()}})

    def count_retry(self, retries: int) -> None:
        from mlflow.entities import Metric, RunTag

        self._client.log_batch(
            self.run_id,
            metrics=[Metric(RETRIES, float(retries), int(time.time() * 1000), 0)],
            tags=[RunTag(Tag.RETRIES, str(retries))],
        )

    def finish(
        self,
        status: TrialStatus,
        *,
        error: str | None = None,
        last_report: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        """End the run: status tag, error text, the time account of its last report (wall time
        and where it went), the selected epoch and its scores, ``history.csv``, run state."""
        from mlflow.entities import Metric, RunTag

        account = (
            EpochResult.from_report(last_report).account_values() if last_report and FOLD_IDS in last_report else {}
        )
        account.pop(EPOCH_GAP_S, None)  # recorded with its epoch
        rows = self.tracker.epoch_rows(self.run_id)
        # The selection at step 0 as all of them, so that a trial resumed and ended again shows
        # its newest selection (MLflow shows a metric's value at its highest step).
        selected = self.selection.selected_metrics(rows) if self.selection is not None else {}
        ending = {Tag.STATUS: status.value, **(tags or {})}
        if error:
            ending[Tag.ERROR] = error[-MAX_TAG_LENGTH:]
        now = int(time.time() * 1000)
        self._client.log_batch(
            self.run_id,
            metrics=[Metric(key, value, now, 0) for key, value in {**account, **selected}.items()],
            tags=[RunTag(key, value) for key, value in ending.items()],
        )
        if rows:
            self._client.log_text(self.run_id, _history_csv(rows), HISTORY_ARTIFACT)
        self._client.set_terminated(self.run_id, status.run_state)


@contextlib.contextmanager
def _tracking_uri_variable(uri: str) -> Iterator[None]:
    """``MLFLOW_TRACKING_URI`` set to ``uri`` meanwhile (what MLflow reads where it takes no client)."""
    before = os.environ.get(TRACKING_URI_VARIABLE)
    os.environ[TRACKING_URI_VARIABLE] = uri
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TRACKING_URI_VARIABLE, None)
        else:
            os.environ[TRACKING_URI_VARIABLE] = before


def _history_csv(rows: Mapping[int, Mapping[str, float]]) -> str:
    """Per-epoch metrics as CSV, one row per epoch."""
    import csv
    import io

    keys = sorted({key for row in rows.values() for key in row})
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["epoch", *keys])
    writer.writeheader()
    for epoch in sorted(rows):
        writer.writerow({"epoch": epoch, **rows[epoch]})
    return out.getvalue()


def _param_text(value: Any) -> str:
    return str(value)[:6000]


if __name__ == "__main__":
    make_empty_store()
