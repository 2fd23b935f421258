"""A sweep from a validated spec: prepare everything that can fail on input, then run Ray Tune.

``prepare`` does every check that needs no Ray and writes nothing to MLflow, so bad input is
refused before a cluster starts. ``run_sweep`` is the only place that builds a Tuner.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, MutableMapping, Sequence

import numpy as np

from pipeline.checks import CheckedInputs, check_inputs, make_checked_folds
from pipeline.inputs.datasets import Dataset
from pipeline.base.environment import Environment, environment_change
from pipeline.base.errors import DataError, ExperimentError, FoldsweepError, InputError, SpecError
from pipeline.inputs.folds import FoldPlan
from pipeline.base.private_hooks import HOOKED_LIBRARIES, RAY_OUTPUT_ENGINE_VARIABLE, require_hooks
from pipeline.inputs.space import SearchSpace
from pipeline.inputs.spec import SweepSpec
from pipeline.contract.results import (BEST_EPOCH, RUNNING_BEST_PREFIX, WORKER_RETIRES, EpochSelection, SweepStatus,
                              TrialStatus)
from pipeline.records.stores import sqlite_path
from pipeline.records.tracking import MAX_TAG_LENGTH, SweepRecord, Tag, Tracker, TrialRecord
from pipeline.engine.runner import TrialSettings

RAY_RESULTS_DIR = "ray_results"


@dataclass(frozen=True)
class PreparedSweep:
    """A sweep whose inputs have all been checked: spec, experiment, data, folds, space."""

    spec: SweepSpec
    experiment_path: Path
    experiment: Any
    dataset: Dataset
    dataset_path: str | None  # a data file, absolute (None for a built-in)
    folds: FoldPlan
    space: SearchSpace
    tracking_uri: str
    num_samples: int
    address: str | None = None
    warnings: tuple[str, ...] = ()  # what may be a mistake but is not refused

    def trial_settings(self) -> TrialSettings:
        return TrialSettings.from_spec(self.spec, experiment_path=self.experiment_path,
                                       dataset_fingerprint=self.dataset.fingerprint, conditions=self.space.conditions,
                                       fit_arguments=self.experiment.fit_arguments)


@dataclass(frozen=True)
class SweepOutcome:
    parent_run_id: str
    experiment_name: str
    records: list[TrialRecord]
    wall_s: float
    ui_path: str = ""  # the MLflow UI's address path of the sweep's trials (pipeline.records.publish)


def ray_results_dir(tracking_uri: str) -> Path:
    """Where Ray Tune keeps a sweep's experiment state (what ``--resume`` restores): beside a
    SQLite store, as its artifacts are, so that a sweep started elsewhere leaves nothing in the
    working directory; in the working directory for a server store."""
    database = sqlite_path(tracking_uri)
    return (database.parent if database is not None else Path.cwd()) / RAY_RESULTS_DIR


def prepare(spec: SweepSpec, *, tracking_uri: str | None = None, num_samples: int | None = None,
            address: str | None = None, hooks: Sequence[str] = HOOKED_LIBRARIES,
            inputs: CheckedInputs | None = None) -> PreparedSweep:
    """Check everything a sweep needs without starting Ray or writing to the tracking store.

    ``hooks``: the libraries whose private hooks are checked (``trial`` uses neither Ray Tune nor MLflow).
    ``inputs``: what ``check_inputs`` already made of the spec's inputs (the commands check them
    before TensorFlow loads); checked here otherwise.

    Raises:
        PrivateHookMissing: an installed library lacks what foldsweep reaches into (``private_hooks``).
        InputError: the experiment, dataset, folds or tracking URI cannot work as asked.
    """
    from pipeline.inputs.hypermodel import load_experiment
    from pipeline.inputs.space import build_space

    if inputs is None:
        inputs = check_inputs(spec, tracking_uri=tracking_uri, num_samples=num_samples, address=address)
    require_hooks(hooks)
    experiment = load_experiment(inputs.experiment_path, spec.experiment_attr, reference=spec.experiment)
    spec = spec.with_fit_early_stopping(experiment.fit_early_stopping).with_fit_class_weight(experiment.fit_class_weight)
    space = build_space(spec, experiment.hyperparameters, own_optimizer=experiment.compiled_optimizer is not None)
    dataset = inputs.dataset
    _check_model_fits_data(spec, experiment, dataset, inputs.dataset_path or dataset.name)
    folds, fold_warnings = make_checked_folds(spec, inputs)
    _check_batch_fits_folds(spec, space, folds)
    return PreparedSweep(
        spec=spec, experiment_path=inputs.experiment_path, experiment=experiment, dataset=dataset,
        dataset_path=inputs.dataset_path, folds=folds, space=space, tracking_uri=inputs.tracking_uri,
        num_samples=inputs.num_samples, address=inputs.address, warnings=(*inputs.warnings, *fold_warnings),
    )


def _check_batch_fits_folds(spec: SweepSpec, space: SearchSpace, folds: FoldPlan) -> None:
    smallest = min(len(fold.train) for fold in folds.folds)
    largest = space.largest_value("batch_size")
    if largest is not None and largest > smallest:
        raise SpecError(f"{spec.source_path}: search.space.batch_size must be <= the smallest training fold "
                        f"({smallest} samples), got {largest}")


# The real samples the default model's outputs are checked on against its loss.
HEAD_CHECK_SAMPLES = 64


def _check_model_fits_data(spec: SweepSpec, experiment: Any, dataset: Dataset, source: str) -> None:
    """The model takes the dataset's samples (built on their shape when it declares no input),
    its outputs are what its loss reads them as, and it has an output for every label of ``y``
    and ``y_test`` (labels 0 and 1 for a one-unit binary head)."""
    expected = experiment.input_shape
    if expected is not None and (len(expected) != len(dataset.input_shape) or any(
            want is not None and want != have for want, have in zip(expected, dataset.input_shape))):
        raise DataError(
            f"dataset: samples of {source!r} have shape {dataset.input_shape}, but the model of "
            f"{spec.experiment} expects inputs of shape {tuple(expected)}")
    head = experiment.head(dataset.x[:HEAD_CHECK_SAMPLES], train=spec.train, labels=dataset.y[:HEAD_CHECK_SAMPLES])
    for name, labels in (("y", dataset.y), ("y_test", dataset.y_test)):
        if labels is None:
            continue
        if head.loss.regression:
            _check_targets_fit_outputs(spec, head, labels, name, source)
        elif head.loss.per_position:
            _check_positions_fit_outputs(spec, head, labels, name, source)
        elif head.loss.binary:
            others = sorted(set(np.unique(labels).tolist()) - {0, 1})
            if others:
                raise DataError(
                    f"dataset: {name} of {source!r} has labels {sorted(np.unique(labels).tolist())}, but the "
                    f"model of {spec.experiment} has one output unit, a binary classifier of labels 0 and 1 "
                    f"(got {others[:10]} besides): for {int(labels.max()) + 1} classes end the model in "
                    f"Dense({int(labels.max()) + 1}, activation='softmax')")
        elif int(labels.max()) >= head.units:
            raise DataError(
                f"dataset: labels of {source!r} go up to {int(labels.max())}, but the model of {spec.experiment} "
                f"has only {head.units} outputs (in {name})")
    if head.loss.per_position and spec.train.class_weight is not None:
        raise SpecError(f"{spec.source_path}: train.class_weight is not yet applied to labels per position (a padded "
                        f"position's label indexes no weight): drop it, got {spec.train.class_weight!r}")
    if head.loss.regression and spec.train.class_weight is not None:
        raise SpecError(f"{spec.source_path}: train.class_weight weighs classes, and {source!r} holds float "
                        f"(regression) targets, which have none: drop it, got {spec.train.class_weight!r}")
    _check_objective_computed(spec, head.scorers, classifier=not head.loss.regression)
    _check_replicas_fit(spec, head.parameters)


def _check_positions_fit_outputs(spec: SweepSpec, head: Any, labels: np.ndarray, name: str, source: str) -> None:
    """Labels per position fill the model's output but its class axis, are classes of it, and are
    negative only where the loss ignores them (``ignore_class``)."""
    loss = head.loss
    target, output = tuple(labels.shape[1:]), tuple(head.output_shape)
    if target != output[:-1]:
        raise DataError(
            f"dataset: {name} of {source!r} holds integer labels of shape {target} per sample (one per position), but "
            f"the model of {spec.experiment} outputs shape {output} per sample and its loss {loss.describe()} wants a "
            f"label for each of its leading axes {output[:-1]} (its last axis, {output[-1]}, are the classes): "
            "make the two agree")
    kept = labels[labels != loss.ignore_class] if loss.ignore_class is not None else labels
    if kept.size and kept.min() < 0:
        raise DataError(
            f"dataset: {name} of {source!r} has negative labels per position (e.g. {int(kept.min())}) that its loss "
            f"{loss.describe()} does not ignore: padded positions need "
            f"keras.losses.SparseCategoricalCrossentropy(ignore_class={int(kept.min())})")
    if kept.size and int(kept.max()) >= head.units:
        raise DataError(f"dataset: labels of {source!r} go up to {int(kept.max())}, but the model of {spec.experiment} "
                        f"has only {head.units} outputs per position (in {name})")


def _check_targets_fit_outputs(spec: SweepSpec, head: Any, targets: np.ndarray, name: str, source: str) -> None:
    """Float targets of one sample have the shape of the model's output for it, or one axis less
    against a last axis of 1 (a target per sample against Dense(1), as Keras' losses take it)."""
    target, output = tuple(targets.shape[1:]), tuple(head.output_shape)
    if target == output or (target + (1,)) == output:
        return
    raise DataError(
        f"dataset: {name} of {source!r} holds float (regression) targets of shape {target} per sample, but the model "
        f"of {spec.experiment} outputs shape {output} per sample and its loss {head.loss.describe()} compares the two "
        f"element by element: end the model in Dense({int(np.prod(target)) if target else 1}) (reshaped to {target or '(1,)'}), "
        "or store targets of its output's shape")

def _check_objective_computed(spec: SweepSpec, scorers: Sequence[Any], *, classifier: bool = True) -> None:
    """``train.metric`` (and an early stopping monitor) is a scalar score the model computes."""
    from pipeline.inputs.scoring import objective_problem

    train = spec.train
    for scorer in scorers:
        if not scorer.scalar:
            raise ExperimentError(
                f"experiment: the model of {spec.experiment} compiles the metric {scorer.name}, which gives several "
                "values per fold (one per class, as F1Score(average=None)); foldsweep records one value per metric "
                "and fold: compile it with average='macro' or 'weighted', or drop it")
    watched = [("train", train.metric, train.mode)]
    if train.early_stopping is not None:
        watched.append(("train.early_stopping", train.early_stopping.monitor, train.early_stopping.objective.mode))
    for section, metric, mode in watched:
        problem = objective_problem(metric, mode, scorers, classifier=classifier)
        if problem:
            key, rule = problem
            key = "monitor" if section != "train" and key == "metric" else key
            raise SpecError(f"{spec.source_path}: {section}.{key} {rule}, got {metric!r}")


# float32 weights, their gradients and two optimizer slots (Adam's moments): what each replica
# of a trial holds at the least, whatever its batch.
BYTES_PER_PARAMETER = 4 * 4


def _check_replicas_fit(spec: SweepSpec, parameters: int) -> None:
    """A trial trains all ``cv.n_repeats x cv.n_splits`` replicas at once: refuse a count whose
    models alone (the default model's size) would not fit in the memory a trial has."""
    from pipeline.engine.runtime import memory_per_trial_mb

    cv, resources = spec.cv, spec.resources
    budget = memory_per_trial_mb(cpus=resources.cpu, gpus=resources.gpu, max_concurrent=resources.max_concurrent)
    needed_mb = cv.replicas * parameters * BYTES_PER_PARAMETER / 2**20
    if budget is not None and needed_mb > budget[0]:
        raise SpecError(
            f"{spec.source_path}: cv.n_repeats: {cv.n_repeats} repeats x {cv.n_splits} folds = {cv.replicas:,} "
            f"replicas of the default model ({parameters:,} parameters) need at least {needed_mb:,.0f} MiB of "
            f"weights, gradients and optimizer state per trial, more than the {budget[0]:,} MiB a trial has "
            f"({budget[1]}); lower cv.n_repeats, got {cv.n_repeats}")


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


def run_sweep(prepared: PreparedSweep, *, on_trial_done: Callable[[TrialRecord], None] | None = None,
              notify: Callable[[str], None] = print, say: Callable[[str], None] = lambda line: None,
              doing: Callable[[str], None] = lambda line: None, resume: bool = False,
              progress: Any = None) -> SweepOutcome:
    """Run all trials on Ray Tune and record them in MLflow; returns the recorded trials.

    Four steps: open the sweep (its parent run, or the one a resume continues), build the
    tuner, fit it, and, once every trial has ended, publish the sweep's tables and refit the best
    config. Whatever happens, the parent run ends in a final state.

    ``progress`` is a Ray Tune callback that shows the sweep as it runs (``pipeline.records.progress``);
    ``doing`` hears what the sweep is doing for a few seconds (starting Ray), ``say`` what it is
    doing that stays worth reading (where it records, the refit), ``notify`` what deserves attention.

    With ``resume``, continue the latest sweep of this spec's name through Ray Tune's restore:
    finished trials stay as they are, unfinished ones go on from their last checkpoint, and the
    same MLflow parent run and trial runs are continued.

    Raises:
        SweepInterrupted: Ctrl-C; what ran is recorded, unfinished trials as KILLED.
        AfterTrialsFailed: the trials ended, but publishing or the refit failed.
    """
    # Ray Tune's own CSV/JSON/TensorBoard loggers duplicate what MLflow records.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    os.environ.setdefault(RAY_OUTPUT_ENGINE_VARIABLE, "0")
    import ray

    started = time.perf_counter()
    tracker = Tracker(prepared.tracking_uri)
    resumable = tracker.resumable_sweep(prepared.spec.name) if resume else None
    started_ray = not ray.is_initialized()
    if started_ray:
        doing(f"joining the Ray cluster at {prepared.address}" if prepared.address else "starting a local Ray")
        connect_ray(prepared.address)
    try:
        cluster = ray.cluster_resources()
        gpu = check_cluster_resources(prepared.spec, cluster, notify)
        parent_run_id, ray_path = _open_sweep(prepared, tracker, resumable, notify)
        resources = prepared.spec.resources
        at_once = int(min(cluster.get("CPU", 0) // resources.cpu, resources.max_concurrent or math.inf))
        say(f"sweep run {parent_run_id} records to {prepared.tracking_uri}; up to {at_once} trial"
            f"{'s' if at_once != 1 else ''} at a time, each on {resources.cpu:g} CPU"
            + (f" and {gpu:g} GPU" if gpu else "") + " (a worker's first trial starts TensorFlow and places the data)")
        try:
            tuner = _build_tuner(prepared, tracker, parent_run_id, ray_path, gpu=gpu, resume=resume,
                                 on_trial_done=on_trial_done, progress=progress)
            configs = _fit(tuner, prepared, tracker, parent_run_id)
        except BaseException as exc:
            interrupted = isinstance(exc, KeyboardInterrupt)
            _close_sweep(prepared, tracker, parent_run_id,
                         SweepStatus.INTERRUPTED if interrupted else SweepStatus.ERROR,
                         error=None if interrupted else traceback.format_exc())
            if interrupted and not isinstance(exc, SweepInterrupted):
                raise SweepInterrupted(parent_run_id) from None
            raise
    finally:
        if started_ray:
            ray.shutdown()
    return _after_trials(prepared, tracker, parent_run_id, configs, notify, say, started)


def _open_sweep(prepared: PreparedSweep, tracker: Tracker, resumable: SweepRecord | None,
                notify: Callable[[str], None]) -> tuple[str, str]:
    """The sweep's parent run and Ray Tune experiment path: new, with the environment it runs in,
    or the resumed sweep's, which keeps the environment it started in (a change is reported)."""
    environment = Environment.current()
    if resumable is not None:
        changed = environment_change(resumable.tags, environment)
        if changed:
            notify(f"warning: sweep run {resumable.run_id} resumes in another environment than it started in: {changed}")
        return tracker.reopen_sweep(resumable)
    spec = prepared.spec
    return tracker.start_sweep(
        name=spec.name, spec_text=spec.source_text, manifest=prepared.folds.manifest(), params=_sweep_params(prepared),
        tags=environment.tags(),
        ray_path_for=lambda run_id: str(ray_results_dir(prepared.tracking_uri) / f"{spec.name}-{run_id[:8]}"))


def _build_tuner(prepared: PreparedSweep, tracker: Tracker, parent_run_id: str, ray_path: str, *, gpu: float,
                 resume: bool, on_trial_done: Callable[[TrialRecord], None] | None, progress: Any = None) -> Any:
    """The sweep's Ray Tune Tuner (restored from ``ray_path`` on a resume), recording through
    an MLflow callback."""
    from ray import tune

    from pipeline.engine.trainable import FoldTrainable
    from pipeline.records.callbacks import MlflowTrialCallback

    spec = prepared.spec
    recording = MlflowTrialCallback(tracker.uri, parent_run_id=parent_run_id, sweep_name=spec.name,
                                    selection=_selection(spec), on_recorded=on_trial_done,
                                    conditions=prepared.space.conditions, searched=prepared.space.searched())
    callbacks = [recording]
    if progress is not None:
        progress.run_ids = recording.run_ids  # trials are named by their runs from their start
        callbacks.append(progress)
    data = {"x": prepared.dataset.x, "y": prepared.dataset.y}
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


def _fit(tuner: Any, prepared: PreparedSweep, tracker: Tracker, parent_run_id: str) -> dict[str, dict[str, Any]]:
    """Run every trial; returns each trial's config by trial id.

    Raises:
        SweepInterrupted: Ray Tune ended ``fit`` early, as it does on Ctrl-C.
    """
    with _retiring_workers():
        results = tuner.fit()
    # Ray Tune ends fit() early, without an exception, on Ctrl-C: fewer trials than planned have
    # ended in the record.
    ended = sum(record.state != "RUNNING" for record in tracker.trial_records(parent_run_id))
    if ended < prepared.space.trial_count(prepared.num_samples):
        raise SweepInterrupted(parent_run_id)
    return {result.metrics.get("trial_id"): result.config for result in results}


@contextlib.contextmanager
def _retiring_workers() -> Iterator[None]:
    """Let a worker that says it should retire (``pipeline.engine.lifespan``) end with its trial.

    Ray Tune decides alone whether a finished trial's actor is kept for the next trial, and a
    ``reset_config`` that refuses the next trial fails that trial. So a retiring worker says so in
    its last result, and while this sweep runs, Ray Tune does not keep that actor: the next
    trial starts in a fresh worker process, and no trial fails or retries for it.
    """
    from ray.tune.execution.tune_controller import TuneController

    keep_for_reuse = TuneController._maybe_cache_trial_actor

    def unless_retiring(controller: Any, trial: Any) -> bool:
        if (trial.last_result or {}).get(WORKER_RETIRES):
            return False
        return keep_for_reuse(controller, trial)

    TuneController._maybe_cache_trial_actor = unless_retiring
    try:
        yield
    finally:
        TuneController._maybe_cache_trial_actor = keep_for_reuse


def _after_trials(prepared: PreparedSweep, tracker: Tracker, parent_run_id: str, configs: dict[str, dict[str, Any]],
                  notify: Callable[[str], None], say: Callable[[str], None], started: float) -> SweepOutcome:
    """Every trial has ended: publish the sweep's tables and plots, refit the best config, and
    close the parent run, whatever fails: FAILED with the traceback if publishing does, FINISHED
    with ``foldsweep.refit=error: ...`` if the refit does (the trials' results stand).

    Raises:
        AfterTrialsFailed: publishing or the refit failed (the parent run is closed).
    """
    from pipeline.records.publish import publish
    from pipeline.records.report import Standings

    spec = prepared.spec
    records = tracker.trial_records(parent_run_id)
    failed: list[str] = []
    status, error, summary, ui_path = SweepStatus.OK, None, {}, ""
    try:
        if spec.train.refit:
            try:
                summary = _refit_best(prepared, tracker, parent_run_id, records, configs, notify, say)
            except Exception as exc:
                summary = {Tag.REFIT: f"error: {type(exc).__name__}: {exc}"[:MAX_TAG_LENGTH]}
                failed.append(f"the refit: {type(exc).__name__}: {exc}")
        try:
            test_scores = {key: value for key, value in summary.items() if key.startswith("test_")}
            standings = Standings.of(records, spec.objective, n_splits=spec.cv.n_splits)
            ui_path = publish(tracker, parent_run_id, standings, sweep_name=spec.name, test_scores=test_scores)
        except Exception as exc:
            status, error = SweepStatus.ERROR, traceback.format_exc()
            failed.append(f"publishing cv_results.csv, the plots and the descriptions: {type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        _close_sweep(prepared, tracker, parent_run_id, SweepStatus.INTERRUPTED)
        raise SweepInterrupted(parent_run_id) from None
    _close_sweep(prepared, tracker, parent_run_id, status, error=error, extra=summary)
    outcome = SweepOutcome(parent_run_id, spec.name, records, time.perf_counter() - started, ui_path)
    if failed:
        raise AfterTrialsFailed(outcome, failed)
    return outcome


def _close_sweep(prepared: PreparedSweep, tracker: Tracker, parent_run_id: str, status: SweepStatus, *,
                 error: str | None = None, extra: Mapping[str, float | str] = {}) -> None:
    """End the parent run as ``status`` with the sweep's counts; trial runs still open (a
    stopped sweep) end KILLED."""
    if status != SweepStatus.OK:
        tracker.close_open_trial_runs(parent_run_id, status=TrialStatus.KILLED, selection=_selection(prepared.spec))
    summary = {**_sweep_summary(tracker.trial_records(parent_run_id), prepared.spec), **extra}
    if error:
        summary[Tag.ERROR] = error[-MAX_TAG_LENGTH:]
    tracker.end_sweep(parent_run_id, status=status, summary=summary)


def _refit_best(prepared: PreparedSweep, tracker: Tracker, parent_run_id: str, records: list[TrialRecord],
                configs: dict[str, dict[str, Any]], notify: Callable[[str], None],
                say: Callable[[str], None]) -> dict[str, float | str]:
    """Train the best config on the whole CV training split; score it on the held-out test split."""
    import tempfile

    from pipeline.inputs.hypermodel import load_builder
    from pipeline.refit import refit, refit_scores
    from pipeline.records.report import ranked

    spec, dataset = prepared.spec, prepared.dataset
    ranking = ranked(records, spec.objective)
    if dataset.x_test is None:
        notify("refit skipped: the dataset has no held-out test split")
        return {Tag.REFIT: "skipped: no test split"}
    if not ranking or ranking[0].trial_id not in configs:
        notify("refit skipped: no trial finished with a finite score")
        return {Tag.REFIT: "skipped: no finished trial"}
    best = ranking[0]
    # The epochs the best trial was scored at (train.select), else all it trained.
    epochs = int(best.metrics.get(BEST_EPOCH, best.params.get("epochs", spec.train.epochs)))
    say(f"refitting {best.run_name} on all {len(dataset.y)} training samples ({epochs} epoch{'s' if epochs != 1 else ''})")
    with tempfile.TemporaryDirectory(prefix="foldsweep-refit-") as directory:
        result = refit(load_builder(prepared.experiment_path, spec.experiment_attr), configs[best.trial_id], dataset,
                       epochs=epochs, recipe=prepared.trial_settings().recipe, directory=Path(directory))
        tracker.publish_sweep_files(parent_run_id, files={result.model_path: None})
    scores = refit_scores(result)
    notify(f"refit of {best.run_name} on all {len(dataset.y)} training samples ({epochs} epoch{'s' if epochs != 1 else ''}): "
           + ", ".join(f"{key} {value:.4f}" for key, value in scores.items()))
    return {**scores, "refit_epochs": float(epochs), Tag.REFIT: "ok", Tag.REFIT_OF: best.run_id}


def _selection(spec: SweepSpec) -> EpochSelection:
    return EpochSelection(spec.objective, spec.train.select)


def _restored_tuner(ray_path: str, trainable: Any, param_space: dict[str, Any], callbacks: list[Any]) -> Any:
    """Ray Tune's restore of an interrupted experiment, reporting to this process's callbacks."""
    from ray import tune

    if not tune.Tuner.can_restore(ray_path):
        raise InputError(f"--resume: Ray Tune has no saved state to resume at {ray_path!r}")
    from pipeline.engine.relocation import movable

    tuner = tune.Tuner.restore(ray_path, trainable, resume_unfinished=True, resume_errored=False,
                               param_space=param_space or None)
    # The restored run config carries the callback pickled by the interrupted driver, which has
    # lost its link to this process (the progress printer); swap in this process's callbacks.
    tuner._local_tuner.get_run_config().callbacks = callbacks
    tune_config = tuner._local_tuner._tune_config
    tune_config.search_alg = movable(tune_config.search_alg, ray_path, tune_config.max_concurrent_trials)
    tune_config.max_concurrent_trials = None  # movable carries the limit, as make_searcher's searchers do
    return tuner


def connect_ray(address: str | None) -> None:
    """Start a local Ray (``start_local_ray``), or join the cluster at ``address``.

    Raises:
        InputError: nothing answers at ``address``.
    """
    import ray

    if address in (None, "local"):
        start_local_ray()
        return
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise InputError(f"resources.address / --address: cannot connect to a Ray cluster at {address!r}: "
                         f"{str(exc).splitlines()[0]}") from None


RAY_TOKEN_VARIABLES = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def start_local_ray(**shape: Any) -> None:
    """A Ray of this process's own (``shape``: ``ray.init``'s ``num_cpus``, ``num_gpus``), whose
    token no other user of the machine can read.

    Ray 2.60 makes a local Ray refuse any connection without its token and, given none, writes a
    new one to ~/.ray/auth_token with the umask's mode: 0644 on most machines, where whoever can
    read the home directory of a shared server could run code as the researcher on this Ray. Ray
    reads RAY_AUTH_TOKEN before any file, and every process it starts (its workers) inherits the
    environment, which only its owner can read (/proc/PID/environ): the token stays there.
    """
    import ray

    give_ray_a_private_token(os.environ)
    # "local": a new Ray even where `ray start` left its cluster's address for a bare ray.init()
    # to join; this process's token would shadow that cluster's own.
    ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level="ERROR", **shape)


def give_ray_a_private_token(environ: MutableMapping[str, str]) -> None:
    """A new random RAY_AUTH_TOKEN in ``environ``, unless it names a token already: the
    researcher's own (RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH, a file Ray reads before
    ~/.ray/auth_token), or the one an earlier Ray of this process got, which Ray keeps for the
    whole process once loaded."""
    if not any(environ.get(name) for name in RAY_TOKEN_VARIABLES):
        environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # 256 bits, as Ray's own tokens


def check_cluster_resources(spec: SweepSpec, cluster: dict[str, float], notify: Callable[[str], None]) -> float:
    """The GPU share per trial to request; refuses a trial larger than the cluster.

    Raises:
        SpecError: resources.cpu (or gpu) per trial exceeds what the cluster has.
    """
    cpus, gpus = cluster.get("CPU", 0), cluster.get("GPU", 0)
    if spec.resources.cpu > cpus:
        raise SpecError(f"{spec.source_path}: resources.cpu must be <= the CPUs of the Ray cluster ({cpus:g}), "
                        f"got {spec.resources.cpu:g}")
    gpu = spec.resources.gpu
    if gpu > 0 and not gpus:
        notify(f"notice: resources.gpu={gpu:g} but the Ray cluster has no GPU: trials run on CPU")
        return 0.0
    if gpu > gpus:
        raise SpecError(f"{spec.source_path}: resources.gpu must be <= the GPUs of the Ray cluster ({gpus:g}), "
                        f"got {gpu:g}")
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
        metric = f"{RUNNING_BEST_PREFIX}{spec.objective.key}" if spec.train.select == "best_epoch" else spec.objective.key
        return DistinctOptunaSearch(space, metric=metric, mode=spec.objective.mode,
                                    sampler=optuna.samplers.TPESampler(seed=spec.search.seed))
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
        return ASHAScheduler(time_attr="training_iteration", max_t=_max_epochs(spec),
                             grace_period=scheduler.grace_period, reduction_factor=scheduler.reduction_factor)
    if scheduler.name == "median":
        return MedianStoppingRule(time_attr="training_iteration", grace_period=scheduler.grace_period,
                                  min_samples_required=scheduler.min_samples_required)
    return FIFOScheduler()


def _max_epochs(spec: SweepSpec) -> int:
    declared = spec.search.space.get("epochs")
    if declared is None:
        return spec.train.epochs
    return int(max(declared.values()) if declared.values() else declared.args[1])


def _sweep_params(prepared: PreparedSweep) -> dict[str, Any]:
    spec = prepared.spec
    return {
        "experiment": spec.experiment,
        "experiment_path": str(prepared.experiment_path),
        "dataset": spec.dataset.label,
        **({"dataset_path": prepared.dataset_path} if prepared.dataset_path else {}),
        "dataset_fingerprint": prepared.dataset.fingerprint,
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
        summary[f"best_{spec.objective.key}"] = selected_score(best, spec.objective.key)
        summary["n_tied_with_best"] = float(len(standings.tied_with_best()))
    return summary
