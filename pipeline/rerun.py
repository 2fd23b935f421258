"""One trial in this process, without Ray: a recorded trial again (`rerun`, ``rerun_recorded``) or
one config of a spec (`trial`, ``trial_of_spec``), through the sweep's own ``TrialRunner``, with
per-epoch output and numeric checks. Both build their ``TrialRequest`` with ``trial_request`` and
run it with ``run_here``, which tells a ``TrialOutput`` what the command prints."""

from __future__ import annotations

import math
import re
import time
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import yaml

from pipeline.base.environment import Environment, environment_change
from pipeline.base.errors import DataError, InputError, SpecError, TrackingError
from pipeline.base.quiet import import_tensorflow_and_keras
from pipeline.contract.account import TimeAccount
from pipeline.contract.plan import (
    ExecutionChoices,
    ThreadPlan,
    TrialPlan,
    plan_differences,
    plan_threads,
    replay_choices,
)
from pipeline.contract.results import (
    DONE,
    EVAL_STEP,
    NAN_EPOCH,
    NAN_FOLD,
    NAN_STEP,
    STOPPED_EPOCH,
    EpochResult,
    EpochSelection,
    TrialStatus,
)
from pipeline.inputs.datasets import load_dataset
from pipeline.inputs.folds import FoldPlan, folds_beside, manifest_identity
from pipeline.inputs.spec import (
    TRAINING_DEFAULTS,
    CVSpec,
    DatasetSpec,
    Objective,
    ParamSpec,
    SweepSpec,
    check_training_param,
    load_spec,
    parse_spec,
    read_yaml,
)
from pipeline.records.report import account_text
from pipeline.records.tracking import Tag, Tracker, TrialRecorder

if TYPE_CHECKING:
    from pipeline.checks import PreparedSweep
    from pipeline.engine.fold_engine import StoppedCall
    from pipeline.engine.profile import EpochProfile


@dataclass(frozen=True)
class RecordedTrial:
    """What MLflow holds of a trial that a rerun needs."""

    run_id: str
    run_name: str
    parent_run_id: str
    spec: SweepSpec
    config: dict[str, Any]
    manifest: dict[str, Any]
    experiment_path: Path
    dataset: DatasetSpec
    plan: TrialPlan | None  # None for trials recorded before plans were
    sweep_tags: Mapping[str, str]  # its sweep's, with the environment it ran in (``pipeline.base.environment``)

    def threads(self, *, eager: bool, check_numerics: bool) -> ThreadPlan:
        """The thread pools the trial ran with (as a sweep's worker sizes them for all its folds,
        for an older record)."""
        if self.plan is not None:
            return self.plan.threads
        return spec_threads(self.spec, n_folds=self.spec.cv.replicas, eager=eager, check_numerics=check_numerics)


class NumericsPart(Enum):
    """What of a training step the first non-finite value came from."""

    LAYER = "layer"  # the forward pass of one of the model's layers
    LAYER_GRADIENT = "layer gradient"  # the backward pass through one of its layers
    GRADIENT_NORM = "gradient norm"  # foldsweep's own health check of the step (``pipeline.engine.fold_engine``)
    OUTSIDE = "outside"  # none of these: the loss, a regularizer, the optimizer's update...


@dataclass(frozen=True)
class NumericsFinding:
    """The first op TensorFlow's numeric checking caught producing NaN/Inf, and where: the fold,
    epoch and step the check stopped (from the fold engine it stopped), and the layer of that
    fold's model the op belongs to, or, for the gradient norm, the variable whose gradient's
    squares went non-finite first and its layer. Empty strings and None where it cannot tell."""

    op_type: str
    node: str  # the graph node ("" when eager: no graph)
    part: NumericsPart
    layer: str = ""  # "conv1d (Conv1D)": a layer the fold's model has
    variable: str = ""  # "conv1d/kernel"
    fold: int | None = None
    epoch: int | None = None
    step: int | None = None  # within the epoch, 0-based; EVAL_STEP in validation

    def place(self) -> str:
        return place_text(self.fold, self.epoch, self.step)

    def describe(self) -> str:
        op = f"op {self.op_type}" + (f", node {self.node}" if self.node else "")
        if self.part is NumericsPart.GRADIENT_NORM:
            what = f"the gradient norm, foldsweep's own check of each step ({op})"
            if self.variable:
                what += (
                    f": the gradient of {self.variable}, a variable of layer {self.layer}, is the first whose sum "
                    "of squares is not finite"
                )
        elif self.part is NumericsPart.LAYER:
            what = f"{op} in layer {self.layer}"
        elif self.part is NumericsPart.LAYER_GRADIENT:
            what = f"{op} in the gradient of layer {self.layer}"
        elif self.node:
            what = f"{op}, outside the model's layers"
        else:
            what = f"{op} (run eagerly, no graph node names its layer; without --eager, one does)"
        place = self.place()
        return f"{place}: {what}" if place else what


def place_text(fold: int | None, epoch: int | None, step: int | None) -> str:
    """``fold 0, epoch 2, step 17``, or ``fold 0, validation of epoch 2`` (as much as is known)."""
    parts = [f"fold {fold}"] if fold is not None else []
    if epoch is not None:
        parts.append(f"validation of epoch {epoch}" if step == EVAL_STEP else f"epoch {epoch}")
    if step is not None and step != EVAL_STEP:
        parts.append(f"step {step}")
    return ", ".join(parts)


def recorded_nan_line(finding: NumericsFinding, recorded_tags: Mapping[str, str]) -> str:
    """Where the recorded trial went NaN (its tags nan_fold, nan_epoch, nan_step), against where
    this run's numeric checking stopped: a rerun may walk another trajectory (numeric checking
    runs without XLA, for one)."""
    if recorded_tags.get(Tag.of(NAN_EPOCH)) is None:
        return "the recorded trial did not go NaN"
    recorded = place_text(*(int(recorded_tags[Tag.of(key)]) for key in (NAN_FOLD, NAN_EPOCH, NAN_STEP)))
    source = "its tags foldsweep.nan_fold, nan_epoch, nan_step"
    if recorded == finding.place():
        return f"the recorded trial went NaN at the same place ({recorded}: {source})"
    return f"the recorded trial went NaN at {recorded} ({source}), not where this run's check stopped"


def parse_assignments(assignments: Sequence[str]) -> dict[str, Any]:
    """``name=value`` pairs, values read as a spec's YAML scalars (``3``, ``0.5``, ``1e-4``, ``true``, ``adam``)."""
    values: dict[str, Any] = {}
    for assignment in assignments:
        name, sep, raw = assignment.partition("=")
        if not sep or not name.strip():
            raise InputError(f"--set must be name=value, got {assignment!r}")
        try:
            values[name.strip()] = read_yaml(raw) if raw.strip() else None
        except yaml.YAMLError:
            raise InputError(
                f"--set {name.strip()}: the value must be a YAML scalar (a number, string or boolean), got {raw!r}"
            ) from None
    return values


def load_recorded_trial(tracker: Tracker, run_id: str) -> RecordedTrial:
    """Read a trial's config, its sweep's spec and fold manifest from the tracking store.

    Raises:
        TrackingError: unknown run id, or a run that is not a foldsweep trial.
    """
    run = tracker.recorded_trial_run(run_id)
    source = Path(f"spec.yaml of sweep run {run.parent_run_id}")
    try:
        document = read_yaml(run.spec_text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{source}: damaged, not valid YAML: {exc}") from None
    spec = parse_spec(document, source_path=source, source_text=run.spec_text)
    experiment_path = Path(run.sweep_params.get("experiment_path", spec.experiment_path))
    # The data file as the sweep resolved it, so that a rerun from another directory finds it.
    dataset = (
        replace(spec.dataset, path=run.sweep_params["dataset_path"])
        if "dataset_path" in run.sweep_params
        else spec.dataset
    )
    try:
        plan = TrialPlan.from_dict(run.plan) if run.plan is not None else None
    except (TypeError, KeyError, AttributeError) as exc:
        raise TrackingError(f"RUN_ID: trial_plan.json of run {run_id} is damaged: {exc}") from None
    return RecordedTrial(
        run.run_id,
        run.run_name,
        run.parent_run_id,
        spec,
        run.config,
        run.manifest,
        experiment_path,
        dataset,
        plan,
        run.sweep_tags,
    )


def _with_recorded_code(tracker: Tracker, recorded: RecordedTrial, out: TrialOutput) -> RecordedTrial:
    """The trial with the experiment's files as its sweep recorded them (``experiment_code``),
    where those beside the experiment changed since or are gone: a rerun trains the code the
    trial trained. Trials recorded without their code rerun the files beside the experiment.

    Raises:
        TrackingError: the recorded code cannot be read from the store's artifacts.
    """
    import atexit
    import shutil
    import tempfile

    from pipeline.records.experiment_code import changed_files

    tag = recorded.sweep_tags.get(Tag.CODE)
    if tag is None:
        return recorded
    changed = changed_files(tag, recorded.experiment_path.parent)
    if not changed:
        return recorded
    destination = Path(tempfile.mkdtemp(prefix="foldsweep-code-"))
    atexit.register(shutil.rmtree, destination, ignore_errors=True)
    try:
        directory = tracker.recorded_code(recorded.parent_run_id, destination)
    except Exception as exc:
        raise TrackingError(
            f"RUN_ID: {', '.join(changed)} changed since sweep run {recorded.parent_run_id} (or is gone), and the code "
            f"it recorded cannot be read from the store ({type(exc).__name__}: {exc})"
        ) from None
    out.tell(
        f"{', '.join(changed)} changed since sweep run {recorded.parent_run_id} recorded it (or is gone): rerunning "
        "the code it recorded"
    )
    return replace(recorded, experiment_path=directory / recorded.experiment_path.name)


def spec_threads(spec: SweepSpec, *, n_folds: int, eager: bool = False, check_numerics: bool = False) -> ThreadPlan:
    """The thread pools a trial of ``spec`` over ``n_folds`` folds gets, as a sweep's worker sizes them."""
    choices = ExecutionChoices(fused=spec.train.fused, eager=eager, check_numerics=check_numerics)
    return plan_threads(choices, cpus=spec.resources.cpu, n_folds=n_folds)


def recorded_folds(recorded: RecordedTrial) -> tuple[Any, Callable[[], FoldPlan]]:
    """The recorded sweep's dataset, refused at once if it no longer matches, and what waits for
    its folds, rebuilt beside the command (``folds_beside``) and refused if they differ.

    Raises:
        DataError: the data's fingerprint, or (from what waits) the folds' index hashes, differ
            from the record.
    """
    dataset = load_dataset(recorded.dataset)
    expected = recorded.manifest["dataset_fingerprint"]
    if dataset.fingerprint != expected:
        raise DataError(
            f"dataset: {recorded.dataset.label!r} no longer matches the data of sweep run "
            f"{recorded.parent_run_id}: fingerprint {dataset.fingerprint[:16]}... now, {expected[:16]}... recorded"
        )
    split = folds_beside(recorded.spec.cv, dataset)

    def wait_for_folds() -> FoldPlan:
        plan = split()
        if manifest_identity(plan.manifest()) != manifest_identity(recorded.manifest):
            raise DataError(
                f"cv: the folds rebuilt from the spec differ from those recorded in sweep run "
                f"{recorded.parent_run_id} (fold_manifest.json)"
            )
        return plan

    return dataset, wait_for_folds


def checked_overrides(
    overrides: Mapping[str, Any], known: set[str], hyperparameters: Any, *, spec_names: Collection[str] = ()
) -> dict[str, Any]:
    """The ``--set`` values, each read as its hyperparameter's type and checked against what
    declares it: the hypermodel's ``hp.Int``/``Float``/``Choice``/``Boolean``/``Fixed``, or the
    spec's rules for foldsweep's training hyperparameters, which the hypermodel may declare too (an
    ``hp.Choice("optimizer", ...)`` of its own): its declaration rules unless the spec's search
    space names it (``spec_names``).

    Raises:
        InputError: a name that is no hyperparameter of the trial, or a value of the wrong type
            or outside the declared range.
    """
    declared = {hp.name: hp for hp in hyperparameters.space}
    checked = {}
    for name, value in overrides.items():
        if name not in known:
            raise InputError(f"--set {name}: not a hyperparameter of this trial; known: {', '.join(sorted(known))}")
        if name in TRAINING_DEFAULTS and (name in spec_names or name not in declared):
            try:
                check_training_param("--set", name, name, ParamSpec("fixed", (value,)))
            except SpecError as exc:
                raise InputError(str(exc)) from None
            checked[name] = value
        elif name in declared:
            checked[name] = _declared_value(declared[name], value)
        else:
            checked[name] = value
    return checked


def _declared_value(hp: Any, value: Any) -> Any:
    """``value`` as the hypermodel declares ``hp``, or a refusal naming the declaration."""
    from keras_tuner.src.engine.hyperparameters import hp_types

    def refuse(rule: str) -> None:
        raise InputError(f"--set {hp.name}: {rule}, got {value!r}")

    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(hp, hp_types.Boolean):
        if not isinstance(value, bool):
            refuse("the hypermodel declares it hp.Boolean: true or false")
        return value
    if isinstance(hp, hp_types.Fixed):
        if value != hp.value:
            refuse(f"the hypermodel fixes it at {hp.value!r} (hp.Fixed)")
        return value
    if isinstance(hp, hp_types.Choice):
        # True == 1 in Python: a boolean only matches a boolean choice.
        matching = [
            choice for choice in hp.values if choice == value and isinstance(choice, bool) == isinstance(value, bool)
        ]
        if not matching:
            refuse(f"the hypermodel declares it hp.Choice of {', '.join(repr(v) for v in hp.values)}")
        return matching[0]
    if isinstance(hp, hp_types.Int):
        if not number or not float(value).is_integer():
            refuse(f"the hypermodel declares it hp.Int: an integer from {hp.min_value} to {hp.max_value}")
        value = int(value)
        step = hp.step or 1
        on_grid = hp.sampling != "linear" or (value - hp.min_value) % step == 0
        if not hp.min_value <= value <= hp.max_value or not on_grid:
            steps = f" in steps of {step}" if step != 1 and hp.sampling == "linear" else ""
            refuse(f"the hypermodel declares it hp.Int from {hp.min_value} to {hp.max_value}{steps}")
        return value
    if isinstance(hp, hp_types.Float):
        if not number or not hp.min_value <= value <= hp.max_value:
            refuse(f"the hypermodel declares it hp.Float from {hp.min_value} to {hp.max_value}")
        return float(value)
    return value


def inactive_overrides(
    config: Mapping[str, Any], overrides: Mapping[str, Any], conditions: Mapping[str, tuple[Any, ...]]
) -> dict[str, str]:
    """The ``--set`` values the trial leaves out because their hyperparameter's condition does
    not hold in ``config`` (``units_2`` with ``num_layers=1``, a clipping threshold without
    clipping), each with why: such a value is neither refused nor used, as the trial's record
    leaves it out."""
    from pipeline.inputs.space import TRAINING_CONDITIONS, config_values

    values = config_values(config)
    left_out = {}
    for name in overrides:
        for condition in (*TRAINING_CONDITIONS.get(name, ()), *conditions.get(name, ())):
            if not condition.is_active(values):
                wanted = ", ".join(repr(value) for value in condition.values)
                left_out[name] = (
                    f"--set {name}={overrides[name]} is left out: {name} only counts when "
                    f"{condition.name} is {wanted}, and this trial has "
                    f"{condition.name}={values.get(condition.name)!r}"
                )
                break
    return left_out


def check_fold(fold: int | None, cv: CVSpec) -> list[int]:
    """The folds to train: all of a trial's (every repeat's), or the one ``--fold`` names."""
    if fold is None:
        return list(range(cv.replicas))
    if not 0 <= fold < cv.replicas:
        repeats = f" ({cv.n_repeats} repeats x {cv.n_splits})" if cv.n_repeats > 1 else ""
        raise InputError(
            f"--fold must be between 0 and {cv.replicas - 1} (the sweep's trials train {cv.replicas} "
            f"folds{repeats}), got {fold}"
        )
    return [fold]


@dataclass(frozen=True)
class TrialRequest:
    """One trial to run in this process, and how: on ``threads`` (configured before TensorFlow
    started), executing ``replay`` (a recorded trial's plan) where the options allow."""

    spec: SweepSpec
    experiment_path: Path
    dataset: Any
    folds: FoldPlan
    config: Mapping[str, Any]
    conditions: Mapping[str, Any]
    fold_ids: Sequence[int]
    threads: ThreadPlan
    epochs: int | None = None
    eager: bool = False
    check_numerics: bool = False
    replay: TrialPlan | None = None
    fit_arguments: Mapping[str, str] = field(default_factory=dict)
    # What the request changes against a recorded trial, besides its plan (--set, --eager).
    changes: tuple[str, ...] = ()
    # When the command began (``time.perf_counter``): where the trial's time account starts.
    started: float | None = None
    # --profile: TensorFlow's profiler around this epoch (1-based), its trace written here.
    profile_epoch: int | None = None
    profile_dir: Path | None = None


def profile_epoch(asked: int | None, *, planned: int) -> int:
    """The epoch ``--profile`` profiles: ``--profile-epoch``, else the first after the one that
    compiles (the first, when it is the only one).

    Raises:
        InputError: an epoch the trial does not train.
    """
    if asked is None:
        return 2 if planned >= 2 else 1
    if not 1 <= asked <= planned:
        trains = f"{planned} epoch" + ("s" if planned != 1 else "")
        raise InputError(f"--profile-epoch must be between 1 and {planned} (the trial trains {trains}), got {asked}")
    return asked


def planned_epochs(spec: SweepSpec, config: Mapping[str, Any], epochs: int | None) -> int:
    """The epochs a trial of ``config`` trains: ``--epochs``, its config's own, else ``train.epochs``."""
    return epochs or config.get("epochs") or spec.train.epochs


@dataclass(frozen=True)
class TrialOptions:
    """What ``foldsweep trial`` and ``foldsweep rerun`` both take from the command line."""

    set_values: tuple[str, ...] = ()  # --set name=value, as typed
    fold: int | None = None
    epochs: int | None = None
    eager: bool = False
    check_numerics: bool = False
    profile: bool = False
    profile_epoch: int | None = None
    # When the command began (``time.perf_counter``): where the trial's time account starts.
    started: float | None = None

    @property
    def profiled(self) -> bool:
        """``--profile``, or ``--profile-epoch``, which implies it."""
        return self.profile or self.profile_epoch is not None


class TrialOutput(Protocol):
    """What a trial run here tells as it goes, for the command to print: a line of figures (the
    plan, an epoch, the profile, the time account) is said whole however long it is; a sentence
    is told, to be wrapped at the console's width."""

    def checked(self, prepared: PreparedSweep) -> None:
        """A ``trial``'s spec passed its checks: what ``prepared`` notes and warns of."""

    def say(self, line: str) -> None:
        """A line whole: figures, or where the recorded trial went NaN against this run."""

    def tell(self, sentence: str) -> None:
        """A sentence: what runs, an early stop, how the trial ended, where a rerun is recorded."""

    def note(self, note: str) -> None:
        """A ``--set`` value the trial leaves out, and why (``inactive_overrides``)."""

    def caution(self, line: str) -> None:
        """What may make a rerun walk another trajectory than the trial it reruns."""

    def non_finite(self, description: str) -> None:
        """Where numeric checking found the first non-finite value (``NumericsFinding.describe``)."""


@dataclass(frozen=True)
class TrialOutcome:
    """How a trial run here ended: its status, the first non-finite value numeric checking found,
    its time account, and the run that records a rerun."""

    status: TrialStatus
    finding: NumericsFinding | None = None
    account: TimeAccount | None = None
    run_id: str | None = None


def trial_of_spec(spec_path: Path, options: TrialOptions, out: TrialOutput) -> TrialOutcome:
    """One config of a spec, run here (``foldsweep trial``): its fixed values, the ``--set``
    values and the defaults (``single_config``), checked as ``validate`` checks the spec, on the
    thread pools a sweep's worker would have.

    Raises:
        InputError: the spec, its data or model, or an option cannot work as asked.
    """
    from pipeline.checks import check_inputs, prepare

    sweep_spec = load_spec(spec_path)
    fold_ids = check_fold(options.fold, sweep_spec.cv)
    assignments = parse_assignments(options.set_values)
    inputs = check_inputs(sweep_spec)
    # Before anything here starts TensorFlow: the thread pools a sweep's worker would have.
    threads = spec_threads(
        sweep_spec, n_folds=len(fold_ids), eager=options.eager, check_numerics=options.check_numerics
    )
    _start_tensorflow(sweep_spec, threads, traced=options.profiled)
    from pipeline.base.private_hooks import TRAINING_LIBRARIES

    prepared = prepare(sweep_spec, hooks=TRAINING_LIBRARIES, inputs=inputs)
    out.checked(prepared)
    experiment, space = prepared.experiment, prepared.space
    overrides = checked_overrides(
        assignments, set(space.domains), experiment.hyperparameters, spec_names=set(sweep_spec.search.space)
    )
    config = single_config(prepared.spec, space, experiment.hyperparameters, overrides)
    config, _ = _without_inactive(config, overrides, space.conditions, out)
    resolved = space.resolve(config)
    shown = {**resolved, **({"epochs": options.epochs} if options.epochs else {})}
    planned = planned_epochs(prepared.spec, resolved, options.epochs)
    profiled = profile_epoch(options.profile_epoch, planned=planned) if options.profiled else None
    out.tell(f"trial of {spec_path}: " + " ".join(f"{k}={v}" for k, v in sorted(shown.items()) if v is not None))
    request = trial_request(
        options,
        spec=prepared.spec,
        experiment=experiment,
        experiment_path=prepared.experiment_path,
        dataset=prepared.dataset,
        folds=prepared.folds,
        space=space,
        config=config,
        fold_ids=fold_ids,
        threads=threads,
        profile_epoch=profiled,
        profile_name=f"trial-{spec_path.stem}",
    )
    return run_here(request, out)


def rerun_recorded(
    tracking_uri: str, run_id: str, options: TrialOptions, out: TrialOutput, *, track: bool = True
) -> TrialOutcome:
    """A recorded trial again, run here (``foldsweep rerun``): its config with the ``--set``
    values, its data and folds (refused if they changed), the plan it executed where the options
    allow, and with ``track`` a run of its own under the trial's sweep.

    Raises:
        InputError: no such store or trial, data or folds that changed, or an option that
            cannot work as asked; what needs no TensorFlow is refused before it loads.
    """
    from pipeline.records.stores import require_existing_store

    # What can be refused without TensorFlow is, first: a wrong id or option answers at once.
    require_existing_store(tracking_uri)
    tracker = Tracker(tracking_uri)
    recorded = _with_recorded_code(tracker, load_recorded_trial(tracker, run_id), out)
    fold_ids = check_fold(options.fold, recorded.spec.cv)
    overrides = parse_assignments(options.set_values)
    planned = planned_epochs(recorded.spec, {**recorded.config, **overrides}, options.epochs)
    # an --set epochs that is no number is refused below, with the other --set values
    profiled = (
        profile_epoch(options.profile_epoch, planned=planned) if options.profiled and isinstance(planned, int) else None
    )
    dataset, wait_for_folds = recorded_folds(recorded)
    # Before anything here starts TensorFlow: the thread pools the trial ran with.
    threads = recorded.threads(eager=options.eager, check_numerics=options.check_numerics)
    _start_tensorflow(recorded.spec, threads, traced=profiled is not None)
    from pipeline.base.private_hooks import TRAINING_LIBRARIES, require_hooks
    from pipeline.checks import load_experiment_and_space

    require_hooks(TRAINING_LIBRARIES)  # its checks build small models: TensorFlow starts here
    experiment, spec, space = load_experiment_and_space(recorded.spec, recorded.experiment_path)
    overrides = checked_overrides(
        overrides,
        set(space.domains) | set(recorded.config),
        experiment.hyperparameters,
        spec_names=set(spec.search.space),
    )
    config, overrides = _without_inactive({**recorded.config, **overrides}, overrides, space.conditions, out)
    folds = wait_for_folds()
    out.tell(
        f"rerun of trial {recorded.run_name} ({recorded.run_id}) of sweep run {recorded.parent_run_id}"
        + (f", with {' '.join(options.set_values)}" if options.set_values else "")
    )
    request = trial_request(
        options,
        spec=spec,
        experiment=experiment,
        experiment_path=recorded.experiment_path,
        dataset=dataset,
        folds=folds,
        space=space,
        config=config,
        fold_ids=fold_ids,
        threads=threads,
        profile_epoch=profiled,
        profile_name=f"rerun-{recorded.run_id[:8]}",
        replay=recorded.plan,
        changes=rerun_changes(recorded, overrides, eager=options.eager, profile_epoch=profiled),
    )
    return run_here(
        request,
        out,
        recorder=_rerun_recorder(tracker, recorded, request) if track else None,
        rerun_of=recorded.run_id,
        recorded_tags=tracker.trial_record(recorded.run_id).tags if options.check_numerics else None,
    )


def _start_tensorflow(spec: SweepSpec, threads: ThreadPlan, *, traced: bool) -> None:
    """TensorFlow loaded and configured as a sweep's worker configures it, on ``threads``; with
    ``traced``, XLA marks each op of its programs for the profiler."""
    import_tensorflow_and_keras()
    if traced:
        from pipeline.engine.profile import enable_xla_op_tracing

        enable_xla_op_tracing()  # before TensorFlow reads its flags
    from pipeline.engine.runner import configure_tensorflow

    configure_tensorflow(gpus=spec.resources.gpu, threads=threads, compile_cache=spec.train.compile_cache)


def _without_inactive(
    config: Mapping[str, Any], overrides: Mapping[str, Any], conditions: Mapping[str, Any], out: TrialOutput
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config`` and ``overrides`` without the ``--set`` values whose condition does not hold in
    ``config``, each said once."""
    left_out = inactive_overrides(config, overrides, conditions)
    for note in left_out.values():
        out.note(note)
    return (
        {name: value for name, value in config.items() if name not in left_out},
        {name: value for name, value in overrides.items() if name not in left_out},
    )


def trial_request(
    options: TrialOptions,
    *,
    spec: SweepSpec,
    experiment: Any,
    experiment_path: Path,
    dataset: Any,
    folds: FoldPlan,
    space: Any,
    config: Mapping[str, Any],
    fold_ids: Sequence[int],
    threads: ThreadPlan,
    profile_epoch: int | None,
    profile_name: str,
    replay: TrialPlan | None = None,
    changes: tuple[str, ...] = (),
) -> TrialRequest:
    """The request of ``trial`` and ``rerun`` alike: the trial of ``config`` with the options, its
    profile (if any) written under ``PROFILES/profile_name``."""
    from pipeline.engine.profile import PROFILES

    return TrialRequest(
        spec=spec,
        experiment_path=experiment_path,
        dataset=dataset,
        folds=folds,
        config=config,
        conditions=space.conditions,
        fold_ids=fold_ids,
        threads=threads,
        epochs=options.epochs,
        eager=options.eager,
        check_numerics=options.check_numerics,
        replay=replay,
        fit_arguments=experiment.fit_arguments,
        profile_epoch=profile_epoch,
        profile_dir=PROFILES / profile_name,
        started=options.started,
        changes=changes,
    )


def _rerun_recorder(tracker: Tracker, recorded: RecordedTrial, request: TrialRequest) -> TrialRecorder:
    """A rerun's own run under its trial's sweep, tagged with the trial it reruns."""
    from pipeline.inputs.space import resolve_config
    from pipeline.records.provenance import Provenance

    # The data file as the sweep resolved it.
    provenance = Provenance.of(request.experiment_path, request.dataset, recorded.dataset)
    return tracker.trial_recorder(
        parent_run_id=recorded.parent_run_id,
        run_name=f"rerun-{recorded.run_name}",
        role="rerun",
        config=resolve_config(request.config, request.conditions),
        tags={**provenance.run_tags, Tag.RERUN_OF: recorded.run_id},
        selection=EpochSelection(request.spec.objective, request.spec.train.select),
        data=provenance.data,
    )


def plan_line(plan: TrialPlan) -> str:
    """How the trial runs: the plan's reason, its steps per launch, threads, random draws, a
    padded last batch, the graph optimizer and the compile it expects."""
    draws = f"; random draws: {plan.random_draws}" if plan.random_draws != "none" else ""
    draws += "; last batch padded" if plan.last_batch_padded else ""
    draws += f"; graph optimizer: {plan.graph_optimizer}"
    estimate = f"; compile ~{plan.compile_estimate_s:.0f} s estimated" if plan.compile_estimate_s is not None else ""
    return (
        f"{plan.reason}; steps per launch: {plan.steps_per_launch}; threads: {plan.threads.describe()}{draws}{estimate}"
    )


def run_here(
    request: TrialRequest,
    out: TrialOutput,
    *,
    recorder: TrialRecorder | None = None,
    rerun_of: str | None = None,
    recorded_tags: Mapping[str, str] | None = None,
) -> TrialOutcome:
    """The trial of ``request`` run here (``run_in_process``), telling ``out`` its plan, each epoch
    as it ends, its profile and how it ended; with ``recorder``, a rerun's run records the
    epochs, what makes it differ from the trial it reruns (``rerun_of``) and how it ended (a
    crash or Ctrl-C too). With ``recorded_tags`` (the rerun trial's record's tags), it says where
    that trial went NaN against the first non-finite value found."""

    def on_plan(plan: TrialPlan, differences: list[str]) -> None:
        out.say(plan_line(plan))
        if differences:
            differs = ", ".join(differences)
            out.caution(f"differs from the trial: {differs}; numbers may differ from the recorded ones")
            if recorder is not None:
                recorder.set_tags({Tag.RERUN_DIFFERS: differs})

    def on_epoch(report: dict[str, Any]) -> None:
        out.say(epoch_line(report, request.spec.train.metric))
        stopped, rule = report.get(STOPPED_EPOCH), request.spec.train.early_stopping
        if stopped is not None and rule is not None:
            out.tell(f"stopped early after epoch {stopped}: train.early_stopping {rule.describe()}")
        if recorder is not None:
            recorder.log_epoch(report)

    def on_profile(profile: EpochProfile) -> None:
        for line in profile.lines():
            out.say(line)
        if recorder is not None:
            # This profile's run of the trace directory, laid out as the viewer reads a logdir.
            run = profile.trace_file.parent
            recorder.log_directory(run, f"profile/{run.relative_to(profile.logdir).as_posix()}")

    try:
        status, finding, last_report = run_in_process(
            request, on_plan=on_plan, on_epoch=on_epoch, on_profile=on_profile
        )
    except BaseException as exc:
        if recorder is not None:
            recorder.finish(
                TrialStatus.KILLED if isinstance(exc, KeyboardInterrupt) else TrialStatus.ERROR,
                error=traceback.format_exc(),
            )
        raise
    if finding is not None:
        out.non_finite(finding.describe())
        if recorded_tags is not None:
            out.say(recorded_nan_line(finding, recorded_tags))
    out.tell(f"status: {status.value}")
    account = EpochResult.from_report(last_report).account if last_report else None
    if account is not None:
        out.say(f"where the time went: {account_text(account)}")
    if recorder is not None:
        found = (
            {}
            if finding is None
            else {
                Tag.NUMERICS_OP: finding.op_type,
                Tag.NUMERICS_NODE: finding.node,
                Tag.NUMERICS_LAYER: finding.layer,
                Tag.NUMERICS_VARIABLE: finding.variable,
                Tag.NUMERICS_FOLD: finding.fold,
                Tag.NUMERICS_EPOCH: finding.epoch,
                Tag.NUMERICS_STEP: finding.step,
            }
        )
        recorder.finish(
            status,
            last_report=last_report,
            tags={tag: str(value) for tag, value in found.items() if value not in ("", None)},
        )
        out.tell(f"recorded as run {recorder.run_id} (tag {Tag.RERUN_OF}={rerun_of})")
    return TrialOutcome(status, finding, account, recorder.run_id if recorder is not None else None)


def run_in_process(
    request: TrialRequest,
    *,
    on_plan: Callable[[TrialPlan, list[str]], None],
    on_epoch: Callable[[dict[str, Any]], None],
    on_profile: Callable[[EpochProfile], None] = lambda profile: None,
) -> tuple[TrialStatus, NumericsFinding | None, dict[str, Any]]:
    """Run one trial here through ``TrialRunner``; calls ``on_plan`` with the plan executed and
    what may make it walk another trajectory than the recorded trial (the request's changes and
    the plan's differences), then ``on_epoch`` with each epoch's report, and ``on_profile`` with
    the profiled epoch's (``request.profile_epoch``). Returns (status, numerics finding, last
    report)."""
    from pipeline.engine.runner import TrialRunner, TrialSettings, set_up_worker

    started = request.started if request.started is not None else time.perf_counter()
    eager, check_numerics, replay = request.eager, request.check_numerics, request.replay
    settings = TrialSettings.from_spec(
        request.spec,
        experiment_path=request.experiment_path,
        dataset_fingerprint=request.dataset.fingerprint,
        conditions=request.conditions,
        fit_arguments=request.fit_arguments,
        eager=eager,
        check_numerics=check_numerics,
    )
    if replay is not None:
        settings = replace(
            settings,
            recipe=replace(settings.recipe, choices=replay_choices(replay, eager=eager, check_numerics=check_numerics)),
        )
    worker = set_up_worker(
        settings, x=request.dataset.x, y=request.dataset.y, one_hot=request.dataset.one_hot, threads=request.threads
    )
    import tensorflow as tf

    runner = TrialRunner(
        request.config,
        worker=worker,
        folds=[request.folds.folds[k] for k in request.fold_ids],
        fold_ids=request.fold_ids,
        settings=settings,
        epochs=request.epochs,
        replay=replay,
        started=started,
    )
    executed = runner.trainer.plan
    on_plan(executed, [*request.changes, *(plan_differences(replay, executed) if replay is not None else [])])
    if check_numerics:
        tf.debugging.enable_check_numerics()
    report: dict[str, Any] = {}
    try:
        while not report.get(DONE):
            if runner.trainer.epoch + 1 == request.profile_epoch:
                report = _profiled_step(runner, request, on_profile)
            else:
                report = runner.step()
            on_epoch(report)
    except tf.errors.InvalidArgumentError as exc:
        if not check_numerics or "Detected Infinity or NaN" not in str(exc):
            raise
        return TrialStatus.NAN, numerics_finding(str(exc), runner.trainer.stopped_call()), report
    finally:
        if check_numerics:
            tf.debugging.disable_check_numerics()
    return EpochResult.from_report(report).status(), None, report


def _profiled_step(runner: Any, request: TrialRequest, on_profile: Callable[[EpochProfile], None]) -> dict[str, Any]:
    """One epoch of ``runner`` under TensorFlow's profiler, then what its trace says."""
    from pipeline.engine.profile import EpochProfiler, summarize

    epoch, logdir = request.profile_epoch, request.profile_dir
    if epoch is None or logdir is None:
        raise ValueError("a profiled epoch needs the request's profile_epoch and profile_dir")
    profiler = EpochProfiler(epoch, logdir)
    profiler.start()
    try:
        report = runner.step()
    finally:
        xspace = profiler.stop()
    clock = runner.trainer.clock
    wall = clock.last_wall_s if clock.last_wall_s is not None else clock.last_train_s + clock.last_eval_s
    on_profile(
        summarize(
            xspace,
            epoch=epoch,
            logdir=profiler.logdir,
            epoch_wall_s=wall,
            gap_s=clock.last_gap_s or 0.0,
            profiler_start_s=profiler.start_s,
        )
    )
    return report


def rerun_changes(
    recorded: RecordedTrial, overrides: Mapping[str, Any], *, eager: bool, profile_epoch: int | None = None
) -> tuple[str, ...]:
    """What a rerun asks to change against its recorded trial, besides the plan."""
    changes = [f"--set {name}={value}" for name, value in overrides.items() if recorded.config.get(name) != value]
    if eager:
        changes.append("--eager (op by op)")
    if profile_epoch is not None:
        changes.append(
            f"--profile (TensorFlow's profiler around epoch {profile_epoch}: its times are the "
            "profiled ones, recorded on the rerun's run only)"
        )
    if recorded.plan is None:
        changes.append("no plan recorded with the trial (executed as the spec decides today)")
    environment = environment_change(recorded.sweep_tags, Environment.current())
    if environment:
        changes.append(f"another environment ({environment})")
    return tuple(changes)


def numerics_finding(message: str, stopped: StoppedCall | None) -> NumericsFinding:
    """What TensorFlow's check-numerics error text says (op type, graph node), placed in the fold
    engine the check stopped: its fold, epoch and step, and its model's layers.

    The node's name scopes are the fold model's, then its layers' (``gradient_tape/`` first for
    the backward pass); foldsweep's gradient norm is ``global_norm/L2Loss``, ``L2Loss_1``, ...,
    one per gradient in ``StoppedCall.norm_variables``' order.
    """
    op = re.search(r'(?:graph|eagerly-executing) op "([^"]+)"', message)
    node = re.search(r"\{\{node ([^}]+?)/CheckNumerics\w*\}\}", message) or re.search(
        r"Detected at node (\S+?)/CheckNumerics", message
    )
    finding = NumericsFinding(
        op_type=op.group(1) if op else "?", node=node.group(1) if node else "", part=NumericsPart.OUTSIDE
    )
    if stopped is None:
        return finding
    finding = replace(finding, fold=stopped.fold, epoch=stopped.epoch, step=stopped.step)
    scopes = finding.node.split("/")
    norm = re.fullmatch(r"global_norm(?:_\d+)?/L2Loss(?:_(\d+))?", finding.node)
    if norm and int(norm.group(1) or 0) < len(stopped.norm_variables):
        variable = stopped.norm_variables[int(norm.group(1) or 0)]
        owner = _owner(stopped.model, variable)
        return replace(
            finding,
            part=NumericsPart.GRADIENT_NORM,
            variable=variable.path,
            layer=_layer_text(owner) if owner is not None else "",
        )
    if re.fullmatch(r"global_norm(?:_\d+)?", scopes[0]):  # the sum of the squares, or its root
        return replace(finding, part=NumericsPart.GRADIENT_NORM)
    backward = scopes[0] == "gradient_tape"
    layers = _scoped_layers(stopped.model, scopes[1:-1] if backward else scopes[:-1])
    if not layers:
        return finding
    return replace(
        finding,
        part=NumericsPart.LAYER_GRADIENT if backward else NumericsPart.LAYER,
        layer="/".join([*(layer.name for layer in layers[:-1]), _layer_text(layers[-1])]),
    )


def _scoped_layers(model: Any, scopes: Sequence[str]) -> list[Any]:
    """The layers, outermost first, of ``model`` whose calls the graph name scopes ``scopes``
    (the model's own first) are.

    Keras opens a layer's name scope twice per call, to build it and to call it, so in a graph a
    layer's ops are under its name with one more ``_N`` suffix than it has (a model's conv1d and
    conv1d_1: conv1d_1 and conv1d_1_2); its name as it is comes second.
    """

    def called(scope: str, layers: Sequence[Any]) -> Any:
        names = (re.sub(r"_\d+$", "", scope), scope)
        return next((layer for name in names for layer in layers if layer.name == name), None)

    if not scopes or called(scopes[0], [model]) is None:
        return []
    found: list[Any] = []
    for scope in scopes[1:]:
        layer = called(scope, getattr(found[-1] if found else model, "layers", ()))
        if layer is None:
            break
        found.append(layer)
    return found


def _owner(model: Any, variable: Any) -> Any:
    """The innermost layer of ``model`` that holds ``variable``."""
    for layer in model.layers:
        if any(held is variable for held in layer.trainable_variables):
            return (_owner(layer, variable) if hasattr(layer, "layers") else None) or layer
    return None


def _layer_text(layer: Any) -> str:
    return f"{layer.name} ({type(layer).__name__})"


def epoch_line(report: Mapping[str, Any], metric: str) -> str:
    """`epoch 3: fold 0 val_loss 0.4123 val_accuracy 0.8812 | fold 1 ... | mean_val_accuracy 0.87`"""

    def number(value: Any) -> str:
        return "nan" if isinstance(value, float) and math.isnan(value) else f"{value:.4f}"

    result = EpochResult.from_report(report)
    folds = " | ".join(
        f"fold {k} train_loss {number(scores.train_loss)} val_loss {number(scores.val_loss)}"
        + (f" val_accuracy {number(scores.val_accuracy)}" if scores.val_accuracy is not None else "")
        + "".join(
            f" val_{name} {number(value)}"
            for name, value in scores.metrics.items()
            if name != "accuracy" or scores.val_accuracy is None  # a compiled "accuracy" is the accuracy shown
        )
        for k, scores in zip(result.fold_ids, result.folds)
    )
    objective = Objective(metric=metric)
    line = f"epoch {result.epoch}: {folds} | {objective.key} {number(result.cv_summary()[objective.key])}"
    if result.nan.event is not None:
        event = result.nan.event
        line += f" | NaN in fold {result.nan.fold} at epoch {event.epoch}, step {event.step}"
    return line


def single_config(spec: SweepSpec, space: Any, hyperparameters: Any, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """One config of a spec without searching: its fixed values, ``--set`` values, and defaults
    (the hypermodel's, or foldsweep's training defaults) for what the spec leaves open. A spec
    distribution whose condition does not hold in the config (``clip_threshold`` with
    ``clipping: none``) needs no value: the trial leaves it out.

    Raises:
        InputError: a spec entry is a distribution and no ``--set`` gives its value.
    """
    from ray.tune.search import sample

    from pipeline.inputs.space import TRAINING_CONDITIONS

    model_defaults = {hp.name: hp.default for hp in hyperparameters.space}
    config: dict[str, Any] = {}
    open_entries = []
    for name, domain in space.domains.items():
        if name in overrides:
            config[name] = overrides[name]
        elif not isinstance(domain, (sample.Domain, dict)):
            config[name] = domain
        elif name in spec.search.space:
            open_entries.append(name)
        elif name in model_defaults:
            config[name] = model_defaults[name]
        else:
            config[name] = TRAINING_DEFAULTS[name]
    # Only a condition whose parent has a value here can tell that an entry is left out.
    conditions = {**TRAINING_CONDITIONS, **space.conditions}
    values = dict(config)
    needed = [
        name
        for name in open_entries
        if not any(
            condition.name in values and not condition.is_active(values) for condition in conditions.get(name, ())
        )
    ]
    if needed:
        raise InputError(
            "search.space: a single trial needs one value for "
            + ", ".join(f"{name} ({spec.search.space[name].kind} in the spec)" for name in needed)
            + "; give it with --set "
            + " --set ".join(f"{name}=..." for name in needed)
        )
    return config
