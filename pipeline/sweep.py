"""A sweep on Ray Tune, from a spec that ``pipeline.checks.prepare`` has checked against its data
and model (bad input is refused there, before a cluster starts). ``run_sweep`` is the only place
that builds a Tuner; ``sweep_of_spec`` is ``foldsweep run``'s one call, from the spec's file to
the sweep's standings.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.base.collector import collector_paused
from pipeline.base.environment import Environment, environment_change
from pipeline.base.errors import FoldsweepError, InputError, SpecError
from pipeline.base.quiet import quiet_environment
from pipeline.base.ray_private import (
    RAY_OUTPUT_ENGINE_VARIABLE,
    lean_local_head,
    report_restored_to,
    restored_here,
    restored_tune_config,
    trial_actors_in_workers_started_ahead,
    trial_actors_not_kept_after,
)
from pipeline.base.read_ahead import record_read_ahead
from pipeline.checks import CheckedInputs, PreparedSweep, prepare_driver
from pipeline.contract.account import Span, TimeAccount, sweep_account
from pipeline.contract.results import (
    BEST_EPOCH,
    RUNNING_BEST_PREFIX,
    SETUP_S,
    SWEEP_FIXED_S,
    SWEEP_PARTS,
    SWEEP_WALL_S,
    TRIAL_WALL_S,
    WORKER_RETIRES,
    EpochSelection,
    SweepStatus,
    TrialStatus,
    sweep_fixed_s,
)
from pipeline.inputs.spec import ResourcesSpec, SweepSpec, load_spec, with_registration
from pipeline.records.provenance import Provenance
from pipeline.records.stores import sqlite_path
from pipeline.records.tracking import MAX_TAG_LENGTH, SweepRecord, Tag, Tracker, TrialRecord, load_tracking_modules

if TYPE_CHECKING:
    from pipeline.inputs.datasets import Dataset
    from pipeline.inputs.space import SearchSpace
    from pipeline.records.progress import ProgressCallback
    from pipeline.records.report import Standings
    from pipeline.refit import EarlyRefit, RefitResult, RefitTarget

RAY_RESULTS_DIR = "ray_results"


@dataclass(frozen=True)
class SweepOutcome:
    parent_run_id: str
    experiment_name: str
    records: list[TrialRecord]
    wall_s: float
    ui_path: str = ""  # the MLflow UI's address path of the sweep's trials (pipeline.records.publish)
    account: TimeAccount | None = None  # where the sweep's wall clock went (SWEEP_PARTS)
    refit_tags: Mapping[str, str] = field(default_factory=dict)  # the refit's model, as the parent run's tags

    def trained_line(self, *, done_before: int = 0, resumed: bool = False) -> str:
        """``8 trials in 95 s; sweep run <id>``; for a resumed sweep, the trials this run trained
        besides the ``done_before`` that had ended before it."""
        trained = len(self.records) - done_before
        counted = f"{trained} trial{'' if trained == 1 else 's'}"
        if resumed:
            counted += (
                f" trained in {self.wall_s:.0f} s ({len(self.records)} in the sweep, "
                f"{done_before} ended before this resume)"
            )
        else:
            counted += f" in {self.wall_s:.0f} s"
        return f"{counted}; sweep run {self.parent_run_id}"


def ray_results_dir(tracking_uri: str) -> Path:
    """Where Ray Tune keeps a sweep's experiment state (what ``--resume`` restores): beside a
    SQLite store, as its artifacts are, so that a sweep started elsewhere leaves nothing in the
    working directory; in the working directory for a server store."""
    database = sqlite_path(tracking_uri)
    return (database.parent if database is not None else Path.cwd()) / RAY_RESULTS_DIR


class AfterTrialsFailed(FoldsweepError):
    """Every trial ended and is recorded, but what comes after them failed; the parent run is
    closed (FAILED when publishing failed, FINISHED with ``foldsweep.refit=error`` when the refit
    did)."""

    def __init__(self, outcome: SweepOutcome, failed: list[str]):
        super().__init__("; ".join(failed))
        self.outcome = outcome
        self.failed = failed


class SweepInterrupted(KeyboardInterrupt):
    """The sweep was stopped (Ctrl-C); its parent run is marked KILLED and can be resumed."""

    def __init__(self, parent_run_id: str):
        super().__init__(parent_run_id)
        self.parent_run_id = parent_run_id


def trials_ended_before_resume(prepared: PreparedSweep) -> tuple[str, int]:
    """The parent run of the sweep a ``--resume`` continues, and how many of its trials have
    ended already (counted once, here).

    Raises:
        InputError: no store, or no sweep of this name to resume.
    """
    from pipeline.records.stores import require_existing_store

    name = prepared.spec.name
    require_existing_store(prepared.tracking_uri, source="--resume", purpose=f"no sweep named {name!r} to resume")
    tracker = Tracker(prepared.tracking_uri)
    parent = tracker.resumable_sweep(name)
    unfinished = (None, TrialStatus.RUNNING, TrialStatus.KILLED)
    return parent.run_id, sum(record.status not in unfinished for record in tracker.trial_records(parent.run_id))


def sweep_progress(prepared: PreparedSweep, *, done_before: int = 0, console: Any, live: bool) -> ProgressCallback:
    """The sweep's progress on ``console``: a live table (``live``, on a terminal), else phase and
    heartbeat lines, each trial shown by its searched values."""
    from pipeline.inputs.space import resolve_config
    from pipeline.records.callbacks import searched_values
    from pipeline.records.progress import ProgressCallback, SweepProgress

    spec = prepared.spec
    searched = prepared.space.searched()  # the hypermodel's searched hyperparameters too

    def key_params(config: Any) -> str:
        return " ".join(searched_values(resolve_config(config, prepared.space.conditions), searched))

    progress = SweepProgress(
        spec.objective,
        trials_planned=prepared.trial_count,
        epochs_per_trial=spec.train.epochs,
        trials_done_before=done_before,
    )
    return ProgressCallback(progress, describe=key_params, console=console, live=live)


@dataclass(frozen=True)
class SweepStart:
    """A sweep checked and about to start (Ray not yet started), as ``sweep_of_spec`` tells it:
    what it runs, and for a ``--resume``, the parent run it continues (``resumes``, else None)
    and how many of that sweep's trials had ended (``trials_ended_before_resume``)."""

    prepared: PreparedSweep
    resumes: str | None = None
    done_before: int = 0


@dataclass(frozen=True)
class SweepEvents:
    """What a sweep tells its caller as it runs, each a callable the caller gives (a command
    prints them; a script may log them or ignore them):

    - ``starting``: the sweep checked, before Ray starts (``SweepStart``; told by
      ``sweep_of_spec``, not ``run_sweep``); it returns the Ray Tune callback that shows the sweep
      as it runs (``sweep_progress``), or None;
    - ``trial_done``: a trial's record, once it ended and is recorded;
    - ``notify``: what deserves attention (warnings, skipped steps);
    - ``say``: what the sweep is doing that stays worth reading (where it records, the refit);
    - ``doing``: what it is doing for a few seconds (checking the data, starting Ray).
    """

    starting: Callable[[SweepStart], Any] = lambda start: None
    trial_done: Callable[[TrialRecord], None] | None = None
    notify: Callable[[str], None] = print
    say: Callable[[str], None] = lambda line: None
    doing: Callable[[str], None] = lambda line: None


@dataclass(frozen=True)
class EndedSweep:
    """A sweep whose every trial ended, for its command to print: how it started, what it
    recorded (``SweepOutcome``), its trials ranked, and what failed after them (``AfterTrialsFailed``;
    empty where nothing did)."""

    start: SweepStart
    outcome: SweepOutcome
    standings: Standings
    failed: tuple[str, ...] = ()

    def trained_line(self) -> str:
        """``SweepOutcome.trained_line``, counting the trials a resume found ended apart."""
        return self.outcome.trained_line(done_before=self.start.done_before, resumed=self.start.resumes is not None)


def sweep_of_spec(
    spec_path: Path,
    events: SweepEvents | None = None,
    *,
    tracking_uri: str | None = None,
    num_samples: int | None = None,
    address: str | None = None,
    resume: bool = False,
    register_model: str | None = None,
    model_alias: str | None = None,
    started_at: float | None = None,
) -> EndedSweep:
    """A spec's sweep, driven from this process (``foldsweep run``): the spec read, with the model
    registration asked for (``with_registration``), and checked as a sweep's driver checks it
    (``prepare_driver``: bad input is refused before anything is written); for a ``resume``, the
    sweep it continues found; then ``events.starting``, the sweep run (``run_sweep``) and its
    trials ranked. The keyword arguments left None take the spec's own.

    Ray starts (or is joined) as soon as the inputs that need no model pass, and runs beside the
    model's checks; a refusal after that stops it before this returns.

    Raises:
        InputError: the spec, its data or model, an option, or no sweep to resume.
        SweepInterrupted: Ctrl-C; what ran is recorded, unfinished trials as KILLED.
    """
    from pipeline.records.report import Standings

    events = events or SweepEvents()
    spec = with_registration(load_spec(spec_path), register_model=register_model, model_alias=model_alias)
    ray_started = False

    def start_ray(inputs: CheckedInputs) -> None:
        # Ray starts as soon as the inputs pass, and the workers it starts ahead load TensorFlow
        # while this process loads its own and checks the model (LOCAL_RAY_SETTINGS). While it
        # waits for Ray's processes, this one loads what opening the store takes.
        nonlocal ray_started
        import ray

        if ray.is_initialized():
            return
        events.doing(_starting_ray(inputs.address))
        quiet_environment()  # before Ray's workers inherit this process's environment
        # Loading modules and starting Ray's processes leave little garbage (import-time cycles),
        # not worth a full collection on the way to loading TensorFlow (``collector_paused``).
        with (
            collector_paused(collect=False),
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-modules") as beside,
        ):
            loading = beside.submit(load_tracking_modules)
            connect_ray(inputs.address, workers=workers_kept(spec, inputs.num_samples))
            ray_started = True
        loading.result()

    try:
        prepared = prepare_driver(
            spec,
            tracking_uri=tracking_uri,
            num_samples=num_samples,
            address=address,
            refit_here=True,
            doing=events.doing,
            inputs_checked=start_ray,
        )
        resumes, done_before = trials_ended_before_resume(prepared) if resume else (None, 0)
        start = SweepStart(prepared, resumes, done_before)
        progress = events.starting(start)
    except BaseException:
        if ray_started:
            stop_ray()
        raise
    failed: tuple[str, ...] = ()
    try:
        outcome = run_sweep(
            prepared, events, resume=resume, started_at=started_at, progress=progress, owns_ray=ray_started
        )
    except AfterTrialsFailed as after:
        outcome, failed = after.outcome, tuple(after.failed)
    spec = prepared.spec
    return EndedSweep(start, outcome, Standings.of(outcome.records, spec.objective, n_splits=spec.cv.n_splits), failed)


def run_sweep(
    prepared: PreparedSweep,
    events: SweepEvents | None = None,
    *,
    resume: bool = False,
    started_at: float | None = None,
    progress: ProgressCallback | None = None,
    owns_ray: bool = False,
) -> SweepOutcome:
    """Run all trials on Ray Tune and record them in MLflow; returns the recorded trials.

    Four steps: open the sweep (its parent run, or the one a resume continues), build the
    tuner, fit it, and, once every trial has ended, publish the sweep's tables and refit the best
    config. Whatever happens, the parent run ends in a final state.

    ``events`` hears what the sweep does as it runs (``SweepEvents``); ``progress``, a Ray Tune
    callback, shows it (``sweep_progress``). ``started_at`` (``time.time()``): when the command
    started, where the sweep's time account starts; else now. Ray is started or joined here
    unless it runs in this process already; ``owns_ray``: the caller started it for this sweep,
    and it stops with the sweep as if started here.

    With ``resume``, continue the latest sweep of this spec's name through Ray Tune's restore:
    finished trials stay as they are, unfinished ones go on from their last checkpoint, and the
    same MLflow parent run and trial runs are continued.

    Raises:
        SweepInterrupted: Ctrl-C; what ran is recorded, unfinished trials as KILLED.
        AfterTrialsFailed: the trials ended, but publishing or the refit failed.
    """
    events = events or SweepEvents()
    # Ray Tune's own CSV/JSON/TensorBoard loggers duplicate what MLflow records.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    os.environ.setdefault(RAY_OUTPUT_ENGINE_VARIABLE, "0")
    import ray

    started = time.perf_counter()
    started_at = time.time() if started_at is None else started_at
    start_ray = not ray.is_initialized()
    if start_ray:
        events.doing(_starting_ray(prepared.address))
    tracker, resumable = _open_tracker(prepared, resume=resume, start_ray=start_ray)
    started_ray = start_ray or owns_ray
    try:
        cluster = ray.cluster_resources()
        gpu = check_cluster_resources(prepared.spec, cluster, events.notify)
        provenance = Provenance.of(prepared.experiment_path, prepared.dataset, prepared.spec.resolved_dataset())
        parent_run_id, ray_path = _open_sweep(prepared, tracker, resumable, events.notify, provenance)
        if prepared.spec.tracking.system_metrics:
            try:
                tracker.monitor_system(parent_run_id)
            except Exception as exc:  # the sweep's record stands without them
                events.notify(f"warning: MLflow's system metrics are not recorded: {type(exc).__name__}: {exc}")
        resources = prepared.spec.resources
        at_once = trials_at_once(cluster.get("CPU", 0), resources)
        events.say(
            f"sweep run {parent_run_id} records to {prepared.tracking_uri}; up to {at_once} trial"
            f"{'s' if at_once != 1 else ''} at a time, each on {resources.cpu:g} CPU"
            + (f" and {gpu:g} GPU" if gpu else "")
            + " (a worker's first trial starts TensorFlow and places the data)"
        )
        early_refit = _early_refit(prepared, tracker, parent_run_id, slots=at_once, say=events.say)
        try:
            tuner = _build_tuner(
                prepared,
                tracker,
                parent_run_id,
                ray_path,
                gpu=gpu,
                slots=at_once,
                resume=resume,
                on_trial_done=events.trial_done,
                progress=progress,
                early_refit=early_refit,
                provenance=provenance,
            )
            configs, records = _fit(tuner, prepared, tracker, parent_run_id)
        except BaseException as exc:
            if early_refit is not None:
                early_refit.close()
            interrupted = isinstance(exc, KeyboardInterrupt)
            _close_sweep(
                prepared,
                tracker,
                parent_run_id,
                SweepStatus.INTERRUPTED if interrupted else SweepStatus.ERROR,
                error=None if interrupted else traceback.format_exc(),
            )
            if interrupted and not isinstance(exc, SweepInterrupted):
                raise SweepInterrupted(parent_run_id) from None
            raise
    except BaseException:
        if started_ray:
            stop_ray()
        raise
    # Ray's shutdown runs beside the refit and the publishing, which need nothing of Ray, and is
    # waited for before the sweep's time account closes.
    ray_stopping = None
    if started_ray:
        ray_stopping = threading.Thread(target=stop_ray, name="ray-shutdown")
        ray_stopping.start()
    return _after_trials(
        prepared,
        tracker,
        parent_run_id,
        configs,
        records,
        events.notify,
        events.say,
        started,
        started_at,
        ray_stopping=ray_stopping,
        early_refit=early_refit,
        provenance=provenance,
    )


def _open_tracker(prepared: PreparedSweep, *, resume: bool, start_ray: bool) -> tuple[Tracker, SweepRecord | None]:
    """The sweep's tracker and, with ``resume``, the sweep it resumes; with ``start_ray``, Ray
    started or joined (``connect_ray``) too.

    A new SQLite store (a copy of the empty store in foldsweep's cache, ``start_from_empty_store``,
    made by MLflow's migrations the first time) is made while Ray starts, which mostly waits for
    Ray's own processes. A store that exists is opened (and
    the sweep to resume found) before Ray starts, so that a store this MLflow cannot open, or
    nothing to resume, stops the sweep before Ray does.
    """
    database = sqlite_path(prepared.tracking_uri)
    if not start_ray or resume or database is None or database.exists():
        tracker = Tracker(prepared.tracking_uri)
        resumable = tracker.resumable_sweep(prepared.spec.name) if resume else None
        if start_ray:
            connect_ray(prepared.address)
        return tracker, resumable
    # One pause of the collector for both, which freezes what both leave once both are done.
    with collector_paused(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="new-store") as beside:
        opening = beside.submit(Tracker, prepared.tracking_uri)
        connect_ray(prepared.address)
    try:
        return opening.result(), None
    except BaseException:
        stop_ray()
        raise


def _open_sweep(
    prepared: PreparedSweep,
    tracker: Tracker,
    resumable: SweepRecord | None,
    notify: Callable[[str], None],
    provenance: Provenance,
) -> tuple[str, str]:
    """The sweep's parent run and Ray Tune experiment path: new, with the environment it runs in,
    where it came from and its data, or the resumed sweep's, which keeps the environment it
    started in (a change is reported)."""
    from pipeline.records.experiment_code import experiment_files

    environment = Environment.current()
    if resumable is not None:
        changed = environment_change(resumable.tags, environment)
        if changed:
            notify(
                f"warning: sweep run {resumable.run_id} resumes in another environment than it started in: {changed}"
            )
        return tracker.reopen_sweep(resumable, _resumed_ray_path(resumable, prepared.tracking_uri))
    spec = prepared.spec
    return tracker.start_sweep(
        name=spec.name,
        spec_text=spec.source_text,
        manifest=prepared.folds.manifest(),
        params=_sweep_params(prepared),
        tags={**environment.tags(), **provenance.run_tags},
        data=provenance.data,
        ray_path_for=lambda run_id: str(ray_results_dir(prepared.tracking_uri) / f"{spec.name}-{run_id[:8]}"),
        code=experiment_files(prepared.experiment_path),
    )


def _build_tuner(
    prepared: PreparedSweep,
    tracker: Tracker,
    parent_run_id: str,
    ray_path: str,
    *,
    gpu: float,
    slots: int,
    resume: bool,
    on_trial_done: Callable[[TrialRecord], None] | None,
    progress: Any = None,
    early_refit: Any = None,
    provenance: Provenance,
) -> Any:
    """The sweep's Ray Tune Tuner (restored from ``ray_path`` on a resume), recording through
    an MLflow callback; ``slots`` trials run at once at most."""
    from ray import tune

    from pipeline.engine.trainable import FoldTrainable
    from pipeline.records.callbacks import MlflowTrialCallback, PlottingLoadedEarly

    spec = prepared.spec
    recording = MlflowTrialCallback(
        tracker.uri,
        parent_run_id=parent_run_id,
        sweep_name=spec.name,
        selection=_selection(spec),
        on_recorded=on_trial_done,
        conditions=prepared.space.conditions,
        searched=prepared.space.searched(),
        run_tags=provenance.run_tags,
        data=provenance.data,
    )
    callbacks: list[tune.Callback] = [recording]
    if progress is not None:
        progress.run_ids = recording.run_ids  # trials are named by their runs from their start
        callbacks.append(progress)
    if early_refit is not None:  # after the recording: it ranks the trials recorded
        callbacks.append(early_refit)
    callbacks.append(PlottingLoadedEarly(slots=slots, n_trials=prepared.trial_count))
    data = {"x": prepared.dataset.x, "y": prepared.dataset.y, "one_hot": prepared.dataset.one_hot}
    trainable = tune.with_resources(
        tune.with_parameters(FoldTrainable, data=data, folds=prepared.folds.folds, settings=prepared.trial_settings()),
        {"cpu": spec.resources.cpu, "gpu": gpu},
    )
    param_space = {} if spec.search.algorithm == "optuna" else prepared.space.param_space
    if resume:
        return _restored_tuner(ray_path, trainable, param_space, callbacks)
    searcher = make_searcher(spec, prepared.space)
    return tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=spec.objective.key,
            mode=spec.objective.mode,
            num_samples=prepared.num_samples,
            search_alg=searcher,
            scheduler=make_scheduler(spec),
            # Ray Tune limits a Searcher's trials itself, but only warns and runs every trial
            # the resources allow when handed a BasicVariantGenerator: that one carries its own.
            max_concurrent_trials=None if _limits_itself(searcher) else spec.resources.max_concurrent,
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=Path(ray_path).name,
            storage_path=str(Path(ray_path).parent),
            callbacks=callbacks,
            failure_config=tune.FailureConfig(max_failures=spec.resources.max_failures),
            # A checkpoint per epoch (the fold models' weights and optimizer state, small next to
            # an epoch's work) lets a retried or resumed trial go on from its last epoch.
            checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1, num_to_keep=1),
            verbose=0,
        ),
    )


def _fit(
    tuner: Any, prepared: PreparedSweep, tracker: Tracker, parent_run_id: str
) -> tuple[dict[str, dict[str, Any]], list[TrialRecord]]:
    """Run every trial; returns each trial's config by trial id, and the sweep's trials as
    recorded once they have all ended.

    Raises:
        SweepInterrupted: Ray Tune ended ``fit`` early, as it does on Ctrl-C.
    """
    with _retiring_workers(), trial_actors_in_workers_started_ahead():
        results = tuner.fit()
    # Ray Tune ends fit() early, without an exception, on Ctrl-C: fewer trials than planned have
    # ended in the record.
    records = tracker.trial_records(parent_run_id)
    if sum(record.state != "RUNNING" for record in records) < prepared.trial_count:
        raise SweepInterrupted(parent_run_id)
    return {result.metrics.get("trial_id"): result.config for result in results}, records


@contextlib.contextmanager
def _retiring_workers() -> Iterator[None]:
    """Let a worker that says it should retire (``pipeline.engine.lifespan``) end with its trial.

    Ray Tune decides alone whether a finished trial's actor is kept for the next trial, and a
    ``reset_config`` that refuses the next trial fails that trial. So a retiring worker says so in
    its last result, and while this sweep runs, Ray Tune does not keep that actor: the next
    trial starts in a fresh worker process, and no trial fails or retries for it.
    """
    with trial_actors_not_kept_after(lambda last_result: bool(last_result.get(WORKER_RETIRES))):
        yield


def _after_trials(
    prepared: PreparedSweep,
    tracker: Tracker,
    parent_run_id: str,
    configs: dict[str, dict[str, Any]],
    records: list[TrialRecord],
    notify: Callable[[str], None],
    say: Callable[[str], None],
    started: float,
    started_at: float,
    *,
    ray_stopping: threading.Thread | None = None,
    early_refit: EarlyRefit | None = None,
    provenance: Provenance,
) -> SweepOutcome:
    """Every trial has ended (``records``, as recorded then): publish the sweep's tables and
    plots, refit the best config, and close the parent run, whatever fails: FAILED with the
    traceback if publishing does, FINISHED with ``foldsweep.refit=error: ...`` if the refit does
    (the trials' results stand). The parent run closes once ``ray_stopping`` (the sweep's own Ray
    shutting down meanwhile) has ended.

    Raises:
        AfterTrialsFailed: publishing or the refit failed (the parent run is closed).
    """
    from pipeline.records.publish import draw_plots_beside, publish
    from pipeline.records.report import Standings

    spec = prepared.spec
    failed: list[str] = []
    status, error, ui_path = SweepStatus.OK, None, ""
    refitted = RefitOutcome({})
    refit_started = time.perf_counter()
    plots: tempfile.TemporaryDirectory[str] | None = None
    drawn: Future[list[Path]] | None = None
    try:
        if spec.train.refit:
            # The plots need only the trials: they are drawn while the refit ends.
            plots = tempfile.TemporaryDirectory(prefix="foldsweep-plots-")
            drawn = draw_plots_beside(tracker, records, spec.objective, Path(plots.name))
            try:
                refitted = _refit_best(
                    prepared, tracker, parent_run_id, records, configs, notify, say, early_refit, provenance=provenance
                )
                if refitted.problem:
                    failed.append(refitted.problem)
            except Exception as exc:
                refitted = RefitOutcome({Tag.REFIT: f"error: {type(exc).__name__}: {exc}"[:MAX_TAG_LENGTH]})
                failed.append(f"the refit: {type(exc).__name__}: {exc}")
        refit_s = time.perf_counter() - refit_started
        summary = refitted.summary
        try:
            test_scores = refitted.test_scores
            standings = Standings.of(records, spec.objective, n_splits=spec.cv.n_splits)
            ui_path = publish(
                tracker, parent_run_id, standings, sweep_name=spec.name, test_scores=test_scores, drawn=drawn
            )
        except Exception as exc:
            status, error = SweepStatus.ERROR, traceback.format_exc()
            failed.append(f"publishing cv_results.csv, the plots and the descriptions: {type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        _close_sweep(prepared, tracker, parent_run_id, SweepStatus.INTERRUPTED)
        raise SweepInterrupted(parent_run_id) from None
    finally:
        if early_refit is not None:
            early_refit.close()
        if drawn is not None:
            wait([drawn])  # what it failed of is publishing's, said above
        if plots is not None:
            plots.cleanup()
        if ray_stopping is not None:
            ray_stopping.join()
    account = _sweep_account(records, started_at=started_at, refit_s=refit_s)
    _close_sweep(prepared, tracker, parent_run_id, status, error=error, extra={**summary, **account_metrics(account)})
    outcome = SweepOutcome(
        parent_run_id,
        spec.name,
        records,
        time.perf_counter() - started,
        ui_path,
        account,
        {key: value for key, value in summary.items() if isinstance(value, str)},
    )
    if failed:
        raise AfterTrialsFailed(outcome, failed)
    return outcome


def _sweep_account(records: Sequence[TrialRecord], *, started_at: float, refit_s: float) -> TimeAccount:
    """Where the sweep's wall clock went until now. Each trial trained from its first step to
    its run's end: its own clock's wall less its set-up, back from when the driver ended its run
    (a resumed sweep's earlier trials fall before this command's start and count for nothing)."""
    spans = [
        Span(record.ended_at - record.metrics[TRIAL_WALL_S] + record.metrics.get(SETUP_S, 0.0), record.ended_at)
        for record in records
        if record.ended_at is not None and TRIAL_WALL_S in record.metrics
    ]
    return sweep_account(started=started_at, ended=time.time(), trials=spans, refit_s=refit_s, parts=SWEEP_PARTS)


def account_metrics(account: TimeAccount) -> dict[str, float]:
    """The sweep account as its parent run records it."""
    return {SWEEP_WALL_S: account.wall_s, **dict(account.parts), SWEEP_FIXED_S: sweep_fixed_s(account)}


def _close_sweep(
    prepared: PreparedSweep,
    tracker: Tracker,
    parent_run_id: str,
    status: SweepStatus,
    *,
    error: str | None = None,
    extra: Mapping[str, float | str] = {},
) -> None:
    """End the parent run as ``status`` with the sweep's counts; trial runs still open (a
    stopped sweep) end KILLED."""
    if status != SweepStatus.OK:
        tracker.close_open_trial_runs(parent_run_id, status=TrialStatus.KILLED, selection=_selection(prepared.spec))
    summary = {**_sweep_summary(tracker.trial_records(parent_run_id), prepared.spec), **extra}
    if error:
        summary[Tag.ERROR] = error[-MAX_TAG_LENGTH:]
    tracker.end_sweep(parent_run_id, status=status, summary=summary)


def _refit_best(
    prepared: PreparedSweep,
    tracker: Tracker,
    parent_run_id: str,
    records: list[TrialRecord],
    configs: Mapping[str, Mapping[str, Any]],
    notify: Callable[[str], None],
    say: Callable[[str], None],
    early_refit: EarlyRefit | None = None,
    *,
    provenance: Provenance,
) -> RefitOutcome:
    """Train the best config on the whole CV training split; score it on the held-out test split
    (the refit ``early_refit`` started beside the last trials, where it refit the best); log it
    as the sweep's model, its scores against it, and register it where the spec asks."""
    from pipeline.refit import refit, refit_scores

    spec, dataset = prepared.spec, prepared.dataset
    if dataset.x_test is None:
        notify("refit skipped: the dataset has no held-out test split")
        return RefitOutcome({Tag.REFIT: "skipped: no test split"})
    target = _refit_target(spec, records, configs)
    if target is None:
        notify("refit skipped: no trial finished with a finite score")
        return RefitOutcome({Tag.REFIT: "skipped: no finished trial"})
    logged: tuple[dict[str, str], str] = ({}, "")
    early, delete_early = early_refit.result_for(target) if early_refit is not None else (None, lambda: None)
    try:
        if early is not None:
            result = early
            tracker.publish_sweep_files(parent_run_id, files={result.model_path: None})
            logged = _log_refit_model(prepared, tracker, parent_run_id, target, result, provenance)
        else:
            say(_refitting(target, dataset))
            with tempfile.TemporaryDirectory(prefix="foldsweep-refit-") as directory:
                result = refit(
                    _builder(prepared),
                    target.config,
                    dataset,
                    epochs=target.epochs,
                    recipe=prepared.trial_settings().recipe,
                    directory=Path(directory),
                    experiment_path=prepared.experiment_path,
                )
                tracker.publish_sweep_files(parent_run_id, files={result.model_path: None})
                logged = _log_refit_model(prepared, tracker, parent_run_id, target, result, provenance)
    finally:
        delete_early()
    scores = refit_scores(result)
    notify(
        f"refit of {target.run_name} on all {len(dataset.y)} training samples ({_epochs(target.epochs)}): "
        + ", ".join(f"{key} {value:.4f}" for key, value in scores.items())
    )
    tags, problem = logged
    registered = tags.get(Tag.REGISTERED_MODEL, "")
    if registered.startswith("models:/"):
        alias = spec.tracking.model_alias
        moved = f" (alias {alias} moved to it: models:/{spec.tracking.register_model}@{alias})" if alias else ""
        notify(f"refit registered as {registered}{moved}")
    # Scores logged against the model are on the parent run already.
    unlogged = {} if tags.get(Tag.REFIT_MODEL, "").startswith("models:/") else scores
    summary: dict[str, float | str] = {
        **unlogged,
        "refit_epochs": float(target.epochs),
        Tag.REFIT: "ok",
        Tag.REFIT_OF: target.run_id,
    }
    return RefitOutcome({**summary, **tags}, test_scores=scores, problem=problem)


@dataclass(frozen=True)
class RefitOutcome:
    """What the refit leaves to record as the parent run closes (``summary``: metrics and tags),
    and its scores on the test split."""

    summary: Mapping[str, float | str]
    test_scores: Mapping[str, float] = field(default_factory=dict)
    problem: str = ""  # what failed of logging or registering the refit's model ("" if nothing)


def _log_refit_model(
    prepared: PreparedSweep,
    tracker: Tracker,
    parent_run_id: str,
    target: RefitTarget,
    result: RefitResult,
    provenance: Provenance,
) -> tuple[dict[str, str], str]:
    """The refit as the sweep's logged model, its test scores against it and the test split,
    registered as a new version where ``tracking.register_model`` names a model: the parent
    run's tags that say so, and what failed ("" if nothing). A failure here leaves the refit and
    its scores recorded; the tag says ``error: ...``."""
    from pipeline.inputs.space import resolve_config
    from pipeline.records.provenance import TESTING
    from pipeline.refit import REFIT_MODEL_NAME, refit_scores

    if result.package_path is None:
        if not result.package_error:
            return {}, ""
        return (
            {Tag.REFIT_MODEL: f"error: {result.package_error}"[:MAX_TAG_LENGTH]},
            f"saving the refit as an MLflow model: {result.package_error}",
        )
    try:
        model_uri = tracker.log_model(
            parent_run_id,
            result.package_path,
            name=REFIT_MODEL_NAME,
            params=resolve_config(target.config, prepared.space.conditions),  # as the trial's params
            tags={**provenance.run_tags, Tag.REFIT_OF: target.run_id},
            scores=refit_scores(result),
            scored_on=next((item for item in provenance.data if item.context == TESTING), None),
        )
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        return {Tag.REFIT_MODEL: f"error: {error}"[:MAX_TAG_LENGTH]}, f"logging the refit's model: {error}"
    logged = {Tag.REFIT_MODEL: model_uri}
    settings = prepared.spec.tracking
    if settings.register_model is not None:
        try:
            version = tracker.register_model(model_uri, name=settings.register_model, alias=settings.model_alias)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            logged[Tag.REGISTERED_MODEL] = f"error: {error}"[:MAX_TAG_LENGTH]
            return logged, f"registering the refit's model as {settings.register_model}: {error}"
        logged[Tag.REGISTERED_MODEL] = f"models:/{settings.register_model}/{version}"
    return logged, ""


def _early_refit(
    prepared: PreparedSweep, tracker: Tracker, parent_run_id: str, *, slots: int, say: Callable[[str], None]
) -> EarlyRefit | None:
    """The refit started beside the last trials, for a sweep that refits (``pipeline.refit.EarlyRefit``)."""
    if not prepared.spec.train.refit or prepared.dataset.x_test is None:
        return None
    from pipeline.refit import EarlyRefit, PreparedRefit

    def best(configs: Mapping[str, Mapping[str, Any]]) -> RefitTarget | None:
        return _refit_target(prepared.spec, tracker.trial_records(parent_run_id), configs)

    def prepare(target: RefitTarget) -> PreparedRefit:
        recipe = prepared.trial_settings().recipe
        return PreparedRefit(
            _builder(prepared),
            target.config,
            prepared.dataset,
            epochs=target.epochs,
            recipe=recipe,
            experiment_path=prepared.experiment_path,
        )

    return EarlyRefit(
        slots=slots,
        n_trials=prepared.trial_count,
        best=best,
        prepare=prepare,
        on_start=lambda target, running: say(_refitting(target, prepared.dataset) + _beside(running)),
    )


def _refit_target(
    spec: SweepSpec, records: Sequence[TrialRecord], configs: Mapping[str, Mapping[str, Any]]
) -> RefitTarget | None:
    """The refit of the best trial of ``records`` (with its config from ``configs``), at the epoch
    it was scored at (train.select), else all it trained; None without a trial with a score."""
    from pipeline.records.report import ranked
    from pipeline.refit import RefitTarget

    ranking = ranked(records, spec.objective)
    if not ranking or ranking[0].trial_id not in configs:
        return None
    best = ranking[0]
    epochs = int(best.metrics.get(BEST_EPOCH, best.params.get("epochs", spec.train.epochs)))
    return RefitTarget(best.trial_id, best.run_id, best.run_name, configs[best.trial_id], epochs)


def _builder(prepared: PreparedSweep) -> Any:
    from pipeline.inputs.hypermodel import load_builder

    return load_builder(prepared.experiment_path, prepared.spec.experiment_attr)


def _refitting(target: RefitTarget, dataset: Dataset) -> str:
    return f"refitting {target.run_name} on all {len(dataset.y)} training samples ({_epochs(target.epochs)})"


def _beside(running: int) -> str:
    return f", beside the {running} trial{'s' if running != 1 else ''} still running" if running else ""


def _epochs(count: int) -> str:
    return f"{count} epoch{'s' if count != 1 else ''}"


def _selection(spec: SweepSpec) -> EpochSelection:
    return EpochSelection(spec.objective, spec.train.select)


def _resumed_ray_path(resumable: SweepRecord, tracking_uri: str) -> str:
    """Where Ray Tune's state of an interrupted sweep is now: where the sweep recorded it, or
    beside the store under the same name, where a moved project (an unpacked archive) has it.

    Raises:
        InputError: neither holds a state Ray Tune can restore (checked before the sweep's run is
            reopened, so that a refused resume writes nothing).
    """
    from ray import tune

    recorded = resumable.tags[Tag.RAY_PATH]
    for path in (recorded, str(ray_results_dir(tracking_uri) / Path(recorded).name)):
        if tune.Tuner.can_restore(path):
            return path
    raise InputError(f"--resume: Ray Tune has no saved state to resume at {recorded!r}")


def _restored_tuner(ray_path: str, trainable: Any, param_space: dict[str, Any], callbacks: list[Any]) -> Any:
    """Ray Tune's restore of an interrupted experiment, reporting to this process's callbacks."""
    from ray import tune

    if not tune.Tuner.can_restore(ray_path):
        raise InputError(f"--resume: Ray Tune has no saved state to resume at {ray_path!r}")
    from pipeline.engine.relocation import movable

    tuner = tune.Tuner.restore(
        ray_path, trainable, resume_unfinished=True, resume_errored=False, param_space=param_space or None
    )
    # The restored run config carries the callback pickled by the interrupted driver, which has
    # lost its link to this process (the progress printer); swap in this process's callbacks.
    if not restored_here(tuner):  # Ray Client's Tuner: restored on the cluster, out of this process's reach
        raise InputError(f"--resume: Ray Tune restored the sweep at {ray_path!r} on the cluster, not in this process")
    report_restored_to(tuner, callbacks)
    tune_config = restored_tune_config(tuner)
    tune_config.search_alg = movable(tune_config.search_alg, ray_path, tune_config.max_concurrent_trials)
    tune_config.max_concurrent_trials = None  # movable carries the limit, as make_searcher's searchers do
    return tuner


def _starting_ray(address: str | None) -> str:
    """What the command says it does while ``connect_ray(address)`` runs."""
    return f"joining the Ray cluster at {address}" if address else "starting a local Ray"


def connect_ray(address: str | None, *, workers: int | None = None) -> None:
    """Start a local Ray (``start_local_ray``, keeping ``workers`` worker processes), or join the
    cluster at ``address``.

    Raises:
        InputError: nothing answers at ``address``.
    """
    import ray

    with collector_paused(collect=False):  # ray.init loads most of Ray's client (its modules stay)
        if address in (None, "local"):
            start_local_ray(workers=workers)
            return
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise InputError(
                f"resources.address / --address: cannot connect to a Ray cluster at {address!r}: "
                f"{str(exc).splitlines()[0]}"
            ) from None


def stop_ray() -> None:
    """``ray.shutdown``: the local Ray's processes stop, or a driver that joined a cluster leaves it."""
    import ray

    ray.shutdown()


def record_start_up_read_ahead(path: Path | None = None) -> Path | None:
    """This environment's read-ahead plan (``pipeline.base.read_ahead``) of what a sweep's driver
    and its workers load as they start, loaded here in the order they load it: this module, Ray,
    MLflow's store, TensorFlow and Keras, the checks, Ray Tune and the trainable (the command's
    own modules are loaded before it reads ahead). ``make install`` and ``make sweep`` record it,
    in a process of its own, into the environment (``path``: elsewhere); None where it cannot be
    recorded. Then the private hooks are checked (after the plan: a driver that trusts their
    record loads nothing for them): where they hold, they are recorded as held for this
    installation, and a fresh install's first sweep trusts that (``require_hooks``); where one
    does not, the command that needs it says so."""
    import ray  # noqa: F401

    from pipeline.base.private_hooks import PrivateHookMissing, require_hooks
    from pipeline.base.quiet import import_tensorflow_and_keras

    load_tracking_modules()
    import_tensorflow_and_keras()
    plan = record_read_ahead(("pipeline.checks", "ray.tune", "pipeline.engine.trainable"), path=path)
    with contextlib.suppress(PrivateHookMissing):
        require_hooks()
    return plan


RAY_TOKEN_VARIABLES = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# What a local Ray's workers load as they start, before any trial reaches them.
WORKER_PRELOAD_MODULE = "pipeline.engine.preload"
# How a local Ray starts, as variables (each one the researcher's own, where set) which every
# process it starts reads. Ray ignores an unknown RAY_<setting>, should it drop a setting.
LOCAL_RAY_SETTINGS = {
    # Ray starts a worker per CPU as the driver connects. Each loads foldsweep, and with it
    # TensorFlow and Keras, while the driver checks the sweep and opens its store, and Ray Tune
    # places the first trials in them (``trial_actors_in_workers_started_ahead``): a trial's
    # worker is warm when the trial is placed.
    "RAY_prestart_worker_first_driver": "1",
    "RAY_preload_python_modules": WORKER_PRELOAD_MODULE,
    # What Ray Tune would give each trial's actor as a runtime environment of its own.
    "PL_DISABLE_FORK": "1",
    # A connection to a local socket that is not listening yet (the raylet's to its own object
    # store, in a race it lost in half of the starts measured) is tried again after this many
    # ms, 1,000 by default: ray.init took 2.9 s instead of 1.9 s. Ten times as many attempts
    # keep the 10 s Ray gives a socket to appear.
    "RAY_raylet_client_connect_timeout_milliseconds": "100",
    "RAY_raylet_client_num_connect_attempts": "100",
}


def start_local_ray(*, workers: int | None = None, **shape: Any) -> None:
    """A Ray of this process's own (``shape``: ``ray.init``'s ``num_cpus``, ``num_gpus``), whose
    token no other user of the machine can read; ``workers``: the worker processes it keeps
    (a sweep's trials at once), one per CPU where None.

    Ray 2.60 makes a local Ray refuse any connection without its token and, given none, writes a
    new one to ~/.ray/auth_token with the umask's mode: 0644 on most machines, where whoever can
    read the home directory of a shared server could run code as the researcher on this Ray. Ray
    reads RAY_AUTH_TOKEN before any file, and every process it starts (its workers) inherits the
    environment, which only its owner can read (/proc/PID/environ): the token stays there.
    """
    import ray

    give_ray_a_private_token(os.environ)
    for name, value in LOCAL_RAY_SETTINGS.items():
        os.environ.setdefault(name, value)
    # Ray ends an idle worker after a second once the node has more workers than this, which by
    # default counts the CPUs that the trials' placement groups leave free: a worker started ahead
    # was ended as the first trials reserved their CPUs, and its trial placed in a cold new one.
    # Those started beyond ``workers`` end about 2 s after they start. The raylet reads it as it
    # starts.
    kept = workers or shape.get("num_cpus") or os.cpu_count() or 1
    with _environment_while("RAY_num_workers_soft_limit", str(kept)):
        # "local": a new Ray even where `ray start` left its cluster's address for a bare ray.init()
        # to join; this process's token would shadow that cluster's own.
        with lean_local_head():
            ray.init(
                address="local", include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR, **shape
            )


@contextlib.contextmanager
def _environment_while(name: str, value: str) -> Iterator[None]:
    """``name`` set to ``value`` while the block runs, unless the environment sets it already."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def give_ray_a_private_token(environ: MutableMapping[str, str]) -> None:
    """A new random RAY_AUTH_TOKEN in ``environ``, unless it names a token already: the
    researcher's own (RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH, a file Ray reads before
    ~/.ray/auth_token), or the one an earlier Ray of this process got, which Ray keeps for the
    whole process once loaded."""
    if not any(environ.get(name) for name in RAY_TOKEN_VARIABLES):
        environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # 256 bits, as Ray's own tokens


def trials_at_once(cpus: float, resources: ResourcesSpec) -> int:
    """How many trials run at once on ``cpus`` CPUs: as many as fit, at most resources.max_concurrent."""
    return int(min(cpus // resources.cpu, resources.max_concurrent or math.inf))


def workers_kept(spec: SweepSpec, num_samples: int) -> int:
    """The worker processes a sweep's local Ray keeps: its trials at once on this machine's CPUs,
    or its trials where fewer."""
    at_once = trials_at_once(os.cpu_count() or 1, spec.resources)
    return max(1, min(at_once, spec.search.trials_at_most(num_samples) or at_once))


def check_cluster_resources(spec: SweepSpec, cluster: dict[str, float], notify: Callable[[str], None]) -> float:
    """The GPU share per trial to request; refuses a trial larger than the cluster.

    Raises:
        SpecError: resources.cpu (or gpu) per trial exceeds what the cluster has.
    """
    cpus, gpus = cluster.get("CPU", 0), cluster.get("GPU", 0)
    if spec.resources.cpu > cpus:
        raise SpecError(
            f"{spec.source_path}: resources.cpu must be <= the CPUs of the Ray cluster ({cpus:g}), "
            f"got {spec.resources.cpu:g}"
        )
    gpu = spec.resources.gpu
    if gpu > 0 and not gpus:
        notify(f"notice: resources.gpu={gpu:g} but the Ray cluster has no GPU: trials run on CPU")
        return 0.0
    if gpu > gpus:
        raise SpecError(
            f"{spec.source_path}: resources.gpu must be <= the GPUs of the Ray cluster ({gpus:g}), got {gpu:g}"
        )
    return gpu


def make_searcher(spec: SweepSpec, space: SearchSpace) -> Any:
    """Random and grid search sample the param space as Ray Tune does; Optuna TPE runs a
    define-by-run space, so that a hyperparameter that does not apply (a threshold without
    clipping) is never suggested. None of them makes a config twice (``pipeline.inputs.searchers``)."""
    if spec.search.algorithm == "optuna":
        import optuna

        from pipeline.inputs.searchers import DistinctOptunaSearch

        # Optuna learns a trial's value from its last report: with train.select best_epoch that is
        # the best of its mean CV curve so far, the score the leaderboard ranks it by (schedulers
        # keep acting on each epoch's own mean, the Tuner's metric).
        metric = (
            f"{RUNNING_BEST_PREFIX}{spec.objective.key}" if spec.train.select == "best_epoch" else spec.objective.key
        )
        return DistinctOptunaSearch(
            space, metric=metric, mode=spec.objective.mode, sampler=optuna.samplers.TPESampler(seed=spec.search.seed)
        )
    from pipeline.inputs.searchers import DistinctVariantGenerator

    return DistinctVariantGenerator(space, seed=spec.search.seed, max_concurrent=spec.resources.max_concurrent or 0)


def _limits_itself(searcher: Any) -> bool:
    from ray.tune.search.basic_variant import BasicVariantGenerator

    return isinstance(searcher, BasicVariantGenerator)


def make_scheduler(spec: SweepSpec) -> Any:
    """Early stopping on the per-epoch CV mean that every trial reports."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, MedianStoppingRule

    scheduler = spec.search.scheduler
    if scheduler.name == "asha":
        return ASHAScheduler(
            time_attr="training_iteration",
            max_t=spec.longest_epochs,
            grace_period=scheduler.grace_period,
            reduction_factor=scheduler.reduction_factor,
        )
    if scheduler.name == "median":
        return MedianStoppingRule(
            time_attr="training_iteration",
            grace_period=scheduler.grace_period,
            min_samples_required=scheduler.min_samples_required,
        )
    return FIFOScheduler()


def _sweep_params(prepared: PreparedSweep) -> dict[str, Any]:
    spec = prepared.spec
    return {
        "experiment": spec.experiment,
        "experiment_path": str(prepared.experiment_path),
        "dataset": spec.dataset.label,
        **({"dataset_path": prepared.dataset_path} if prepared.dataset_path else {}),
        "dataset_fingerprint": prepared.dataset.fingerprint,
        **(
            {"dataset_classes": ",".join(prepared.dataset.class_names)}
            if prepared.dataset.class_names is not None
            else {}
        ),
        "n_train_samples": len(prepared.dataset.y),
        **{f"cv.{key}": value for key, value in asdict(spec.cv).items()},
        "search.algorithm": spec.search.algorithm,
        "search.scheduler": spec.search.scheduler.name,
        "search.num_samples": prepared.num_samples,
        "search.seed": spec.search.seed,
        **{f"train.{key}": value for key, value in asdict(spec.train).items()},
    }


def _sweep_summary(records: list[TrialRecord], spec: SweepSpec) -> dict[str, float | str]:
    from pipeline.records.report import Standings, selected_score

    summary: dict[str, float | str] = {
        "n_trials": float(len(records)),
        "n_failed": float(sum(record.status is TrialStatus.ERROR for record in records)),
        "n_nan": float(sum(record.status is TrialStatus.NAN for record in records)),
        "n_pruned": float(sum(record.status is TrialStatus.PRUNED for record in records)),
    }
    standings = Standings.of(records, spec.objective, n_splits=spec.cv.n_splits)
    if standings.ranked:
        best = standings.ranked[0]
        summary[Tag.BEST_RUN_ID] = best.run_id
        best_score = selected_score(best, spec.objective.key)
        if best_score is not None:  # as every ranked trial's is
            summary[f"best_{spec.objective.key}"] = best_score
        summary["n_tied_with_best"] = float(len(standings.tied_with_best()))
    return summary
