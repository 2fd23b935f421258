"""The ``foldsweep`` command: parse arguments, call the pipeline, map failures to exit codes.

Exit codes: 0 the command did its job (a sweep whose trials partly failed still completed),
2 bad input (spec, data, experiment, URI), 1 an internal error.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.text import Text

from pipeline.base.errors import FoldsweepError, InputError
from pipeline.base.quiet import import_tensorflow_and_keras, quiet_environment
from pipeline.inputs.spec import TrackingSpec

# TensorFlow's C++ chatter would bury the command's own output: its log levels are set before
# anything imports it, and the commands that train import it through
# ``import_tensorflow_and_keras``.
quiet_environment()

app = typer.Typer(
    help="Hyperparameter sweeps with k-fold cross-validation of Keras CNNs on Ray Tune, tracked in MLflow.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Captured output (CI logs, pipes) gets room for the leaderboard's columns. No markup: what is
# printed holds a researcher's values and messages, whose brackets ("[low, high]") rich would
# take for styles and drop; the few styled words are Text.
console = Console(width=None if sys.stdout.isatty() else 150, markup=False)
errors = Console(stderr=True, markup=False)


def styled(label: str, style: str, rest: str = "") -> Text:
    """``label`` in ``style``, then ``rest`` as it is."""
    return Text.assemble((label, style), rest)


DEFAULT_UI_PORT = 5000
TrackingUriOption = typer.Option(
    None, "--tracking-uri", help=f"MLflow tracking URI [default: the spec's tracking.uri, or {TrackingSpec.uri}]"
)
# The store of the commands that read one: the spec's default store.
StoreOption = typer.Option(TrackingSpec.uri, "--tracking-uri", help="MLflow tracking URI")


def exit_codes(command: Callable[..., Any]) -> Callable[..., Any]:
    """Bad input -> one message and exit 2; foldsweep's own other errors -> one message and exit 1;
    anything unexpected -> traceback and exit 1."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except InputError as exc:
            errors.print(styled("error:", "bold red", f" {exc}"), highlight=False, soft_wrap=True)
            raise typer.Exit(code=2) from None
        except FoldsweepError as exc:  # not the input's fault, yet nothing a traceback would explain
            errors.print(styled("error:", "bold red", f" {exc}"), highlight=False, soft_wrap=True)
            raise typer.Exit(code=1) from None
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            errors.print("interrupted")
            raise typer.Exit(code=130) from None
        except Exception:
            errors.print(styled("internal error", "bold red", " (please report it with the traceback below)"))
            errors.print(traceback.format_exc(), highlight=False)
            raise typer.Exit(code=1) from None

    return wrapper


@app.command()
@exit_codes
def validate(spec: Path = typer.Argument(..., help="Sweep spec (YAML)")) -> None:
    """Check a spec completely (keys, types, ranges, experiment, data, folds) without running it."""
    from pipeline.checks import check_inputs, prepare
    from pipeline.inputs.spec import load_spec

    sweep_spec = load_spec(spec)
    inputs = check_inputs(sweep_spec)
    import_tensorflow_and_keras()
    from pipeline.engine.runtime import hide_gpus

    hide_gpus()  # as a sweep's driver: a check needs no GPU, and takes none from a sweep running there
    prepared = prepare(sweep_spec, inputs=inputs)
    folds = prepared.folds.manifest()["folds"]
    console.print(
        styled(
            "ok",
            "green",
            f" {spec}: experiment {prepared.spec.experiment}, dataset {prepared.dataset.name} "
            f"{prepared.dataset.x.shape}, {_replicas_text(prepared.spec.cv)} "
            f"(val sizes {', '.join(str(f['val_size']) for f in folds)}), "
            f"{len(prepared.space.domains)} hyperparameters, {prepared.spec.search.algorithm} search, "
            f"{prepared.trial_count} trials",
        ),
        highlight=False,
    )
    for line in compile_notes(prepared.spec, prepared.experiment):
        console.print(line, highlight=False)
    if prepared.dataset.one_hot:
        console.print(
            f"labels: one-hot rows of {prepared.dataset.one_hot_classes} classes, split by class; the loss and "
            "metrics get the rows, as fit gives them",
            highlight=False,
        )
    console.print(prepared.stacking_note(), highlight=False)
    _print_warnings(prepared)


class _Doing:
    """What a command is doing while nothing else shows (seconds each): a line on a terminal that
    the next one replaces, and that leaves nothing behind (an error after it stays one message);
    nothing in a log. ``say`` prints a line that stays, on both."""

    def __init__(self) -> None:
        self._status: Any = None

    def __call__(self, text: str) -> None:
        if not sys.stdout.isatty():
            return
        if self._status is None:
            self._status = console.status(text)
            self._status.start()
        else:
            self._status.update(text)

    def say(self, line: str) -> None:
        self.done()
        console.print(line, style="dim", highlight=False, soft_wrap=True)

    def done(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _trials_ended_before_resume(prepared: Any, planned: int) -> int:
    """The trials the sweep a ``--resume`` continues has ended already (said once, here).

    Raises:
        InputError: no store, or no sweep of this name to resume.
    """
    from pipeline.contract.results import TrialStatus
    from pipeline.records.stores import require_existing_store
    from pipeline.records.tracking import Tracker

    name = prepared.spec.name
    require_existing_store(prepared.tracking_uri, source="--resume", purpose=f"no sweep named {name!r} to resume")
    tracker = Tracker(prepared.tracking_uri)
    parent = tracker.resumable_sweep(name)
    unfinished = (None, TrialStatus.RUNNING, TrialStatus.KILLED)
    done = sum(record.status not in unfinished for record in tracker.trial_records(parent.run_id))
    console.print(f"resuming sweep {name} (run {parent.run_id}): {done} of {planned} trials done", highlight=False)
    return done


def _print_warnings(prepared: Any, *, num_samples_source: str = "search.num_samples") -> None:
    notice = prepared.space.repeats_notice(prepared.num_samples, source=num_samples_source)
    if notice:
        console.print(styled("notice:", "yellow", f" {notice}"), highlight=False, soft_wrap=True)
    for warning in prepared.warnings:
        errors.print(styled("warning:", "yellow", f" {warning}"), highlight=False, soft_wrap=True)


def _print_standings_notes(standings: Any, tracking_uri: str) -> None:
    """Below a leaderboard: how many trials are tied with the best, and how to rerun the best."""
    from pipeline.records.report import rerun_command

    if standings.ties_line():
        console.print(standings.ties_line(), highlight=False, soft_wrap=True)
    command = rerun_command(standings, tracking_uri, program=program_name())
    if command:
        console.print(Text.assemble("rerun the best trial: ", (command, "bold")), highlight=False, soft_wrap=True)


def _print_compile_share(records: Any) -> None:
    """After a sweep's account: the share of its trials' wall clock that went to compiling."""
    from pipeline.records.report import compile_share_text

    line = compile_share_text(records)
    if line:
        console.print(line, highlight=False, soft_wrap=True)


def _print_refit_model(tags: Any, tracking_uri: str) -> None:
    """The refit's logged model and how to load and serve it, by this environment's python and
    mlflow (named by their directory where they are not the ones on the PATH)."""
    from pipeline.records.report import refit_model_lines

    here = Path(sys.executable).parent
    on_path = shutil.which("python")
    tools = None if on_path is not None and Path(on_path).parent.resolve() == here.resolve() else here
    for line in refit_model_lines(tags, tracking_uri, tools=tools):
        console.print(line, highlight=False, soft_wrap=True)


def _replicas_text(cv: Any) -> str:
    if cv.n_repeats == 1:
        return f"{cv.n_splits} folds"
    return f"{cv.n_repeats} x {cv.n_splits} folds ({cv.replicas} replicas)"


def compile_notes(spec: Any, experiment: Any) -> list[str]:
    """What of a hypermodel's own compile and fit() the trials use, and what the spec replaces."""
    notes = []
    optimizer = experiment.compiled_optimizer
    schedule = experiment.compiled_schedule
    if optimizer is not None:
        named = [name for name in ("optimizer", "learning_rate") if name in spec.search.space]
        if "optimizer" in named:
            rate = f"its {schedule} schedule" if schedule else "its learning rate"
            notes.append(
                f"search.space.optimizer replaces the {optimizer} optimizer that {spec.experiment} compiles "
                f"({rate} and settings too); the model's own loss is kept"
            )
        elif "learning_rate" in named and schedule:
            notes.append(
                f"search.space.learning_rate replaces the {schedule} schedule of the {optimizer} optimizer "
                f"that {spec.experiment} compiles with a constant; its other settings and loss are kept"
            )
        elif "learning_rate" in named:
            notes.append(
                f"search.space.learning_rate replaces the learning rate of the {optimizer} optimizer that "
                f"{spec.experiment} compiles; its other settings and loss are kept"
            )
        else:
            rate = f" with its {schedule} schedule" if schedule else ""
            notes.append(
                f"the {optimizer} optimizer{rate} and loss that {spec.experiment} compiles are used, one copy per fold"
            )
    for name, source in experiment.fit_arguments.items():
        notes.append(f"{name} comes from {spec.experiment}'s fit() (hyperparameter {source!r})")
    rule = experiment.fit_early_stopping
    if rule is not None:
        if spec.train.early_stopping == rule:
            notes.append(
                f"EarlyStopping(monitor='val_{rule.monitor}', patience={rule.patience}) in {spec.experiment}'s "
                f"fit() becomes train.early_stopping: {rule.describe()}, on the trial's mean CV curve (one "
                "decision for all folds)"
            )
        else:
            notes.append(
                f"the spec's train.early_stopping {spec.train.early_stopping.describe()} replaces the "
                f"EarlyStopping in {spec.experiment}'s fit()"
            )
        if experiment.fit_restores_best_weights:
            notes.append(
                "restore_best_weights=True is what train.select: best_epoch already does: each trial is scored "
                "at its best epoch, and the refit trains that many epochs"
            )
    return notes


@app.command()
@exit_codes
def datasets() -> None:
    """List the built-in datasets with their shapes and sizes (generating any not yet cached)."""
    from rich.table import Table

    from pipeline.inputs.datasets import BUILTIN_DESCRIPTIONS, BUILTINS, data_dir_source, load_dataset
    from pipeline.inputs.spec import DatasetSpec

    table = Table(title="built-in datasets (default options)")
    for column in ("name", "CV samples", "test samples", "sample shape", "classes", "groups", "what"):
        table.add_column(column)
    for name in BUILTINS:
        data = load_dataset(DatasetSpec(name=name))
        groups = str(len(set(data.groups.tolist()))) if data.groups is not None else "-"
        table.add_row(
            name,
            str(len(data.y)),
            str(len(data.y_test)) if data.y_test is not None else "-",
            str(data.input_shape),
            str(data.n_classes),
            groups,
            BUILTIN_DESCRIPTIONS.get(name, ""),
        )
    console.print(table)
    console.print(f"built-in datasets are cached in {data_dir_source()}", highlight=False, soft_wrap=True)


@app.command()
@exit_codes
def run(
    spec: Path = typer.Argument(..., help="Sweep spec (YAML)"),
    tracking_uri: str | None = TrackingUriOption,
    num_samples: int | None = typer.Option(None, "--num-samples", help="Override search.num_samples"),
    address: str | None = typer.Option(
        None,
        "--address",
        help="Join this Ray cluster (host:port) instead of starting a local one [default: resources.address]",
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the latest sweep of this spec (after Ctrl-C or "
        "a killed driver): finished trials are kept, unfinished ones go on",
    ),
    register_model: str | None = typer.Option(
        None,
        "--register-model",
        help="Register the refit as a new version of this model [default: tracking.register_model]",
    ),
    model_alias: str | None = typer.Option(
        None,
        "--model-alias",
        help="Move this alias (e.g. champion) of the registered model to the new version "
        "[default: tracking.model_alias; none moves]",
    ),
) -> None:
    """Run a sweep: every config cross-validated over all folds; ends with the leaderboard."""
    started_at = time.time()  # the sweep's time account starts here (the interpreter took ~0.1 s before)
    from pipeline.checks import check_inputs, prepare
    from pipeline.inputs.spec import load_spec, with_registration

    sweep_spec = with_registration(load_spec(spec), register_model=register_model, model_alias=model_alias)
    doing = _Doing()
    doing(f"checking the data and folds of {spec}")
    inputs = check_inputs(sweep_spec, tracking_uri=tracking_uri, num_samples=num_samples, address=address)
    doing(f"loading TensorFlow and building the model of {sweep_spec.experiment}")
    import_tensorflow_and_keras()
    if sweep_spec.train.refit and sweep_spec.train.compile_cache:
        # The refit compiles in this process (on CPU, below), whose TensorFlow reads its XLA
        # flags in prepare.
        from pipeline.base.compile_cache import activate, device_kind

        activate(device_kind=device_kind(0))
    from pipeline.engine.runtime import hide_gpus

    # The driver holds no GPU memory: its TensorFlow (the default model built in prepare, the
    # refit) sees no GPU, and every GPU is the trials'. So the refit trains on CPU: TensorFlow
    # fixes its devices here, long before the refit, and a GPU visible to the driver would keep
    # a CUDA context, and all the memory the refit grew into (TensorFlow's allocator never
    # gives it back), for the whole sweep.
    hide_gpus()
    from pipeline.contract.results import TrialStatus
    from pipeline.records.report import (
        Standings,
        leaderboard_table,
        selected_epoch,
        selected_score,
        short_run_id,
        status_text,
    )
    from pipeline.sweep import run_sweep

    prepared = prepare(sweep_spec, inputs=inputs)
    doing.done()
    sweep_spec = prepared.spec
    planned = prepared.trial_count
    done_before = _trials_ended_before_resume(prepared, planned) if resume else 0
    objective = sweep_spec.objective.key
    console.print(
        Text.assemble(
            "sweep ",
            (sweep_spec.name, "bold"),
            f": {planned} trials x {_replicas_text(sweep_spec.cv)}, "
            f"{_count(sweep_spec.train.epochs, 'epoch')}, dataset {prepared.dataset.name} {prepared.dataset.x.shape}, "
            f"tracking {prepared.tracking_uri}",
        ),
        highlight=False,
    )
    _print_warnings(prepared, num_samples_source="--num-samples" if num_samples else "search.num_samples")
    progress = _progress(prepared, done_before=done_before)

    def trial_done(record: Any) -> None:
        progress.trial_recorded(record)
        score = selected_score(record, objective)
        # A NaN trial's CV mean counts its NaN folds as the worst score: not a score to show.
        shown = (
            f" ({objective} {score:.4f} at epoch {selected_epoch(record)})"
            if score is not None and record.status is not TrialStatus.NAN
            else ""
        )
        reason = record.error.strip().splitlines()[-1] if record.error.strip() else ""
        console.print(
            f"  {record.label} ({short_run_id(record.run_id)}): {status_text(record)}{shown}"
            f"{' - ' + reason if reason else ''}",
            highlight=False,
        )

    from pipeline.sweep import AfterTrialsFailed, SweepInterrupted

    failed: list[str] = []
    try:
        outcome = run_sweep(
            prepared,
            on_trial_done=trial_done,
            resume=resume,
            progress=progress,
            say=doing.say,
            doing=doing,
            notify=lambda line: console.print(line, style="yellow", highlight=False),
            started_at=started_at,
        )
    except SweepInterrupted as interrupted:
        again = " ".join([program_name(), *(shlex.quote(arg) for arg in sys.argv[1:] if arg != "--resume")])
        errors.print(
            f"interrupted: sweep run {interrupted.parent_run_id} stopped, unfinished trials marked KILLED. "
            f"Resume with: {again} --resume",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(code=130) from None
    except AfterTrialsFailed as after:
        outcome, failed = after.outcome, after.failed
    finally:
        doing.done()
        progress.close()
    standings = Standings.of(outcome.records, sweep_spec.objective, n_splits=sweep_spec.cv.n_splits)
    console.print(leaderboard_table(standings, title=f"{sweep_spec.name}: leaderboard"))
    _print_standings_notes(standings, prepared.tracking_uri)
    trained = len(outcome.records) - done_before
    resumed = f" ({len(outcome.records)} in the sweep, {done_before} ended before this resume)" if resume else ""
    console.print(
        f"{_count(trained, 'trial')} {'trained ' if resume else ''}in {outcome.wall_s:.0f} s{resumed}; "
        f"sweep run {outcome.parent_run_id}",
        highlight=False,
    )
    if outcome.account is not None:
        from pipeline.records.report import sweep_account_text

        console.print(
            f"where the sweep's time went: {sweep_account_text(outcome.account)}", highlight=False, soft_wrap=True
        )
    _print_compile_share(outcome.records)
    _print_refit_model(outcome.refit_tags, prepared.tracking_uri)
    _print_ui_address(prepared.tracking_uri, outcome.ui_path, sweep=sweep_spec.name)
    if failed:
        for what in failed:
            errors.print(
                styled("error:", "bold red", f" every trial ended and is recorded, but {what}"),
                highlight=False,
                soft_wrap=True,
            )
        raise typer.Exit(code=1)


@app.command()
@exit_codes
def report(
    sweep: str | None = typer.Argument(None, help="Sweep name or parent run id [default: the latest sweep]"),
    tracking_uri: str = StoreOption,
) -> None:
    """Print a recorded sweep's leaderboard, NaN and throughput tables; refresh its plots,
    descriptions and its view in the MLflow UI."""
    from pipeline.base.environment import recorded_environment
    from pipeline.base.private_hooks import require_hooks
    from pipeline.contract.results import recorded_sweep_account
    from pipeline.records.publish import publish
    from pipeline.records.report import (
        Standings,
        account_rows,
        account_table,
        leaderboard_table,
        nan_table_rows,
        rows_table,
        sweep_account_text,
        throughput_rows,
    )
    from pipeline.records.tracking import Tracker

    _check_existing_store(tracking_uri)
    require_hooks(["mlflow"])
    tracker = Tracker(tracking_uri)
    parent = tracker.find_sweep(sweep)
    records = tracker.trial_records(parent.run_id)
    standings = Standings.of(records, parent.objective, n_splits=parent.n_splits)
    console.print(leaderboard_table(standings, title=f"{parent.name}: leaderboard"))
    _print_standings_notes(standings, tracking_uri)
    console.print(rows_table(nan_table_rows(records), "NaN failures by batch size and clipping"))
    console.print(rows_table(throughput_rows(records), "throughput by batch size (medians)"))
    time_rows = account_rows(records)
    if time_rows:
        console.print(account_table(time_rows))
    sweep_account = recorded_sweep_account(parent.metrics)
    if sweep_account is not None:
        console.print(
            f"where the sweep's time went: {sweep_account_text(sweep_account)}", highlight=False, soft_wrap=True
        )
    _print_compile_share(records)
    test_scores = {key: value for key, value in parent.metrics.items() if key.startswith("test_")}
    if test_scores:
        console.print(
            "refit on the held-out test split: "
            + ", ".join(f"{key} {value:.4f}" for key, value in sorted(test_scores.items())),
            highlight=False,
        )
    _print_refit_model(parent.tags, tracking_uri)
    for line in recorded_environment(parent.tags):
        console.print(f"environment: {line}", highlight=False, soft_wrap=True)
    ui_path = publish(tracker, parent.run_id, standings, sweep_name=parent.name, test_scores=test_scores)
    console.print(
        f"{len(records)} trials of sweep run {parent.run_id}; cv_results.csv, plots and descriptions refreshed on it.",
        highlight=False,
    )
    _print_ui_address(tracking_uri, ui_path, sweep=parent.name)


FoldOption = typer.Option(None, "--fold", help="Only this fold (0-based)")
EpochsOption = typer.Option(None, "--epochs", min=1, help="Train this many epochs instead")
EagerOption = typer.Option(False, "--eager", help="Run eagerly (no tf.function), for debugging")
NumericsOption = typer.Option(
    False, "--check-numerics", help="TensorFlow numeric checking: stop at the first NaN/Inf and name its op and layer"
)
SetOption = typer.Option([], "--set", help="name=value: change one hyperparameter (repeatable)")
ProfileOption = typer.Option(
    False,
    "--profile",
    help="Run TensorFlow's profiler around one epoch and say where its time went (trace under profiles/)",
)
ProfileEpochOption = typer.Option(
    None,
    "--profile-epoch",
    help="The epoch --profile profiles (implies it) [default: the first after the compiling one]",
)


@app.command()
@exit_codes
def trial(
    spec: Path = typer.Argument(..., help="Sweep spec (YAML)"),
    set_values: list[str] = SetOption,
    fold: int | None = FoldOption,
    epochs: int | None = EpochsOption,
    eager: bool = EagerOption,
    check_numerics: bool = NumericsOption,
    profile: bool = ProfileOption,
    profile_epoch: int | None = ProfileEpochOption,
) -> None:
    """Run one config of a spec in this process (no search, no Ray), printing each epoch."""
    started = time.perf_counter()  # the trial's time account counts the command's start-up
    from pipeline.checks import check_inputs, prepare
    from pipeline.inputs.spec import load_spec
    from pipeline.rerun import (
        TrialRequest,
        check_fold,
        checked_overrides,
        inactive_overrides,
        parse_assignments,
        planned_epochs,
        single_config,
        spec_threads,
    )
    from pipeline.rerun import profile_epoch as check_profile_epoch

    sweep_spec = load_spec(spec)
    fold_ids = check_fold(fold, sweep_spec.cv)
    assignments = parse_assignments(set_values)
    inputs = check_inputs(sweep_spec)
    import_tensorflow_and_keras()
    from pipeline.base.private_hooks import TRAINING_LIBRARIES
    from pipeline.engine.runner import configure_tensorflow

    # Before anything here starts TensorFlow: the thread pools a sweep's worker would have.
    threads = spec_threads(sweep_spec, n_folds=len(fold_ids), eager=eager, check_numerics=check_numerics)
    profiled = profile or profile_epoch is not None
    if profiled:
        _trace_xla_ops()
    configure_tensorflow(gpus=sweep_spec.resources.gpu, threads=threads, compile_cache=sweep_spec.train.compile_cache)
    prepared = prepare(sweep_spec, hooks=TRAINING_LIBRARIES, inputs=inputs)
    _print_warnings(prepared)
    overrides = checked_overrides(assignments, set(prepared.space.domains), prepared.experiment.hyperparameters)
    config = single_config(prepared.spec, prepared.space, prepared.experiment.hyperparameters, overrides)
    config = _without_inactive(config, inactive_overrides(config, overrides, prepared.space.conditions))
    shown = {**prepared.space.resolve(config), **({"epochs": epochs} if epochs else {})}
    planned = planned_epochs(prepared.spec, prepared.space.resolve(config), epochs)
    profiled_epoch = check_profile_epoch(profile_epoch, planned=planned) if profiled else None
    console.print(
        f"trial of {spec}: " + " ".join(f"{k}={v}" for k, v in sorted(shown.items()) if v is not None), highlight=False
    )
    _run_here(
        TrialRequest(
            spec=prepared.spec,
            experiment_path=prepared.experiment_path,
            dataset=prepared.dataset,
            folds=prepared.folds,
            config=config,
            conditions=prepared.space.conditions,
            fold_ids=fold_ids,
            threads=threads,
            epochs=epochs,
            eager=eager,
            check_numerics=check_numerics,
            fit_arguments=prepared.experiment.fit_arguments,
            profile_epoch=profiled_epoch,
            profile_dir=PROFILES / f"trial-{spec.stem}",
            started=started,
        ),
        tracking=None,
    )


@app.command()
@exit_codes
def rerun(
    run_id: str = typer.Argument(..., help="MLflow run id of a trial"),
    tracking_uri: str = StoreOption,
    fold: int | None = FoldOption,
    epochs: int | None = EpochsOption,
    eager: bool = EagerOption,
    check_numerics: bool = NumericsOption,
    set_values: list[str] = SetOption,
    no_track: bool = typer.Option(False, "--no-track", help="Do not record the rerun in MLflow"),
    profile: bool = ProfileOption,
    profile_epoch: int | None = ProfileEpochOption,
) -> None:
    """Rerun one recorded trial in this process, with its config, data, folds and execution plan."""
    started = time.perf_counter()  # the trial's time account counts the command's start-up
    from pipeline.records.tracking import Tracker
    from pipeline.rerun import (
        TrialRequest,
        check_fold,
        checked_overrides,
        inactive_overrides,
        load_recorded_trial,
        parse_assignments,
        planned_epochs,
        recorded_folds,
        rerun_changes,
    )
    from pipeline.rerun import profile_epoch as check_profile_epoch

    # What can be refused without TensorFlow is, first: a wrong id or option answers at once.
    _check_existing_store(tracking_uri)
    tracker = Tracker(tracking_uri)
    recorded = load_recorded_trial(tracker, run_id)
    fold_ids = check_fold(fold, recorded.spec.cv)
    overrides = parse_assignments(set_values)
    profiled = profile or profile_epoch is not None
    planned = planned_epochs(recorded.spec, {**recorded.config, **overrides}, epochs)
    # an --set epochs that is no number is refused below, with the other --set values
    profiled_epoch = (
        check_profile_epoch(profile_epoch, planned=planned) if profiled and isinstance(planned, int) else None
    )
    dataset, wait_for_folds = recorded_folds(recorded)
    import_tensorflow_and_keras()
    from pipeline.base.private_hooks import TRAINING_LIBRARIES, require_hooks
    from pipeline.engine.runner import configure_tensorflow
    from pipeline.inputs.hypermodel import load_experiment
    from pipeline.inputs.space import build_space

    # Before anything here starts TensorFlow: the thread pools the trial ran with.
    threads = recorded.threads(eager=eager, check_numerics=check_numerics)
    if profiled_epoch is not None:
        _trace_xla_ops()
    configure_tensorflow(
        gpus=recorded.spec.resources.gpu, threads=threads, compile_cache=recorded.spec.train.compile_cache
    )
    require_hooks(TRAINING_LIBRARIES)  # its checks build small models: TensorFlow starts here
    experiment = load_experiment(recorded.experiment_path, recorded.spec.experiment_attr)
    spec = recorded.spec.with_fit_early_stopping(experiment.fit_early_stopping).with_fit_class_weight(
        experiment.fit_class_weight
    )
    space = build_space(
        recorded.spec, experiment.hyperparameters, own_optimizer=experiment.compiled_optimizer is not None
    )
    overrides = checked_overrides(overrides, set(space.domains) | set(recorded.config), experiment.hyperparameters)
    left_out = inactive_overrides({**recorded.config, **overrides}, overrides, space.conditions)
    overrides = {name: value for name, value in overrides.items() if name not in left_out}
    config = _without_inactive({**recorded.config, **overrides}, left_out)
    folds = wait_for_folds()
    console.print(
        f"rerun of trial {recorded.run_name} ({recorded.run_id}) of sweep run {recorded.parent_run_id}"
        + (f", with {' '.join(set_values)}" if set_values else ""),
        highlight=False,
    )
    request = TrialRequest(
        spec=spec,
        experiment_path=recorded.experiment_path,
        dataset=dataset,
        folds=folds,
        config=config,
        conditions=space.conditions,
        fold_ids=fold_ids,
        threads=threads,
        epochs=epochs,
        eager=eager,
        check_numerics=check_numerics,
        replay=recorded.plan,
        fit_arguments=experiment.fit_arguments,
        profile_epoch=profiled_epoch,
        profile_dir=PROFILES / f"rerun-{recorded.run_id[:8]}",
        started=started,
        changes=rerun_changes(recorded, overrides, eager=eager, profile_epoch=profiled_epoch),
    )
    _run_here(
        request,
        tracking=None if no_track else (tracker, recorded),
        recorded_tags=tracker.trial_record(recorded.run_id).tags if check_numerics else None,
    )


def profile_lines(profile: Any) -> list[str]:
    """What a profiled epoch (``pipeline.engine.profile.EpochProfile``) says, as printed."""
    import importlib.util

    def part(seconds: float) -> str:
        return f"{seconds:.3f} s ({seconds / profile.wall_s:.0%})" if profile.wall_s > 0 else f"{seconds:.3f} s"

    parts = ", ".join(f"{name} {part(seconds)}" for name, seconds in profile.parts.items())
    lines = [
        f"profile of epoch {profile.epoch}: its wall clock {profile.wall_s:.3f} s = {parts}; the gap holds the "
        f"profiler's start, {profile.profiler_start_s:.3f} s",
        "top operations by self time, all folds (share of all operations' self time):",
    ]
    lines += [f"  {op.self_s:9.4f} s  {op.share:6.1%}  {op.name}" for op in profile.top_ops]
    lines.append(
        f"no operation runs for {profile.host_between_share:.0%} of the training launches' time: the host "
        "between launches (dispatch, loop control, Python)"
    )
    viewer = f"xprof --logdir={shlex.quote(str(profile.logdir))} --port=6006"
    if importlib.util.find_spec("xprof") is None:  # the optional extra (pyproject.toml: profile)
        viewer = f"uv run --extra profile {viewer}"
    lines.append(f"trace: {profile.trace_file}; open it with: {viewer}")
    return lines


# Where --profile writes its traces (TensorFlow's profiler adds plugins/profile/<time>/ below).
PROFILES = Path("profiles")


def _trace_xla_ops() -> None:
    """XLA marks each op of its programs for the profiler: before TensorFlow reads its flags."""
    from pipeline.engine.profile import enable_xla_op_tracing

    enable_xla_op_tracing()


def _without_inactive(config: dict[str, Any], left_out: dict[str, str]) -> dict[str, Any]:
    """The config without the ``--set`` values whose condition does not hold, each said once."""
    for note in left_out.values():
        console.print(styled("note:", "yellow", f" {note}"), highlight=False, soft_wrap=True)
    return {name: value for name, value in config.items() if name not in left_out}


def _run_here(request: Any, *, tracking: Any, recorded_tags: Any = None) -> None:
    """The in-process trial both `trial` and `rerun` run, printing each epoch as it ends; a rerun
    also says (and records) what makes it differ from the trial it reruns, and where that trial
    went NaN (``recorded_tags``, its record's tags) against the first non-finite value found."""
    from pipeline.contract.results import STOPPED_EPOCH, EpochResult, EpochSelection, TrialStatus
    from pipeline.inputs.space import resolve_config
    from pipeline.records.report import account_text
    from pipeline.records.tracking import Tag
    from pipeline.rerun import epoch_line, recorded_nan_line, run_in_process

    recorder = None
    if tracking is not None:
        from pipeline.records.provenance import Provenance

        tracker, recorded = tracking
        # The data file as the sweep resolved it.
        provenance = Provenance.of(request.experiment_path, request.dataset, recorded.dataset)
        recorder = tracker.trial_recorder(
            parent_run_id=recorded.parent_run_id,
            run_name=f"rerun-{recorded.run_name}",
            role="rerun",
            config=resolve_config(request.config, request.conditions),
            tags={**provenance.run_tags, Tag.RERUN_OF: recorded.run_id},
            selection=EpochSelection(request.spec.objective, request.spec.train.select),
            data=provenance.data,
        )

    def on_plan(plan: Any, differences: list[str]) -> None:
        draws = f"; random draws: {plan.random_draws}" if plan.random_draws != "none" else ""
        draws += "; last batch padded" if plan.last_batch_padded else ""
        estimate = (
            f"; compile ~{plan.compile_estimate_s:.0f} s estimated" if plan.compile_estimate_s is not None else ""
        )
        console.print(
            f"{plan.reason}; steps per launch: {plan.steps_per_launch}; threads: {plan.threads.describe()}{draws}{estimate}",
            highlight=False,
            soft_wrap=True,
        )
        if differences:
            differs = ", ".join(differences)
            console.print(
                f"differs from the trial: {differs}; numbers may differ from the recorded ones",
                style="yellow",
                highlight=False,
                soft_wrap=True,
            )
            if recorder is not None:
                recorder.set_tags({Tag.RERUN_DIFFERS: differs})

    def on_epoch(report: dict[str, Any]) -> None:
        console.print(epoch_line(report, request.spec.train.metric), highlight=False, soft_wrap=True)
        if report.get(STOPPED_EPOCH) is not None:
            console.print(
                f"stopped early after epoch {report[STOPPED_EPOCH]}: train.early_stopping "
                f"{request.spec.train.early_stopping.describe()}",
                highlight=False,
            )
        if recorder is not None:
            recorder.log_epoch(report)

    def on_profile(profile: Any) -> None:
        for line in profile_lines(profile):
            console.print(line, highlight=False, soft_wrap=True)
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
        console.print(
            styled("first non-finite value:", "bold red", f" {finding.describe()}"), highlight=False, soft_wrap=True
        )
        if recorded_tags is not None:
            console.print(recorded_nan_line(finding, recorded_tags), highlight=False, soft_wrap=True)
    console.print(f"status: {status.value}", highlight=False)
    account = EpochResult.from_report(last_report).account if last_report else None
    if account is not None:
        console.print(f"where the time went: {account_text(account)}", highlight=False, soft_wrap=True)
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
        console.print(f"recorded as run {recorder.run_id} (tag {Tag.RERUN_OF}={recorded.run_id})", highlight=False)


def _check_existing_store(tracking_uri: str) -> None:
    """Commands that read a recorded sweep refuse a store that does not exist (rather than
    creating an empty one)."""
    from pipeline.records.stores import require_existing_store

    require_existing_store(tracking_uri, source="--tracking-uri", purpose="there is no recorded sweep to read")


def _progress(prepared: Any, *, done_before: int = 0) -> Any:
    """Live progress on a terminal; phase and heartbeat lines in a log."""
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
    return ProgressCallback(progress, describe=key_params, console=console, live=sys.stdout.isatty())


def _print_ui_address(tracking_uri: str, ui_path: str, *, sweep: str, port: int = DEFAULT_UI_PORT) -> None:
    console.print(
        Text.assemble(
            "Open the MLflow UI on this sweep: ",
            (ui_command(tracking_uri, sweep=sweep), "bold"),
            f" then browse http://127.0.0.1:{port}{ui_path}",
        ),
        highlight=False,
        soft_wrap=True,
    )


def program_name() -> str:
    """This command as the user can type it again: ``foldsweep`` when that is on the PATH, else
    the path it was invoked by (``.venv/bin/foldsweep``)."""
    program = "foldsweep"
    invoked = Path(sys.argv[0])
    on_path = shutil.which("foldsweep")
    if invoked.name == "foldsweep" and (on_path is None or Path(on_path).resolve() != invoked.resolve()):
        program = (
            os.path.relpath(invoked)
            if not invoked.is_absolute() or invoked.is_relative_to(Path.cwd())
            else str(invoked)
        )
    return shlex.quote(program)


def ui_command(tracking_uri: str, *, sweep: str | None = None) -> str:
    """The exact command that opens the UI on this store, as the user can paste it."""
    named = f" {shlex.quote(sweep)}" if sweep else ""
    return f"{program_name()} ui{named} --tracking-uri {shlex.quote(tracking_uri)}"


@app.command()
@exit_codes
def ui(
    sweep: str | None = typer.Argument(
        None, help="Open on this sweep (name or parent run id) [default: the latest sweep, if any]"
    ),
    tracking_uri: str = StoreOption,
    port: int = typer.Option(DEFAULT_UI_PORT, "--port", help="Port on 127.0.0.1"),
) -> None:
    """Start the MLflow UI on 127.0.0.1 for a tracking store, opening on a sweep's trials."""
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
    address = f"http://127.0.0.1:{port}"
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
    # MLflow's UI runs a server with worker processes of its own; in a session of its own the
    # whole group can be stopped, so that stopping `foldsweep ui` leaves nothing running. Its
    # chatter goes to standard error: standard output is the address line alone.
    server = subprocess.Popen(command, start_new_session=True, env=environment, stdout=sys.__stderr__)
    stopped = False

    def stop(signum: int = signal.SIGTERM, frame: Any = None) -> None:
        nonlocal stopped
        stopped = True
        stop_process_tree(server.pid)

    # Ctrl-C, `kill`, a closed terminal or a process manager: each stops the server with it.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    try:
        # The address is printed once it opens: MLflow takes seconds to start.
        code = _wait_until_answering(server, address)
        if code is None:
            console.print(
                f"MLflow UI for {tracking_uri} at {address} (Ctrl-C stops it)", highlight=False, soft_wrap=True
            )
            code = server.wait()
        elif not stopped:
            errors.print(
                styled(
                    "error:",
                    "bold red",
                    f" the MLflow UI server exited with code {code} before it answered at http://127.0.0.1:{port}",
                ),
                highlight=False,
                soft_wrap=True,
            )
            code = code or 1  # `mlflow ui` ends with 0 even when its port is taken
    except KeyboardInterrupt:
        stop()
        server.wait()
        return
    except TimeoutError as exc:
        stop()
        raise FoldsweepError(str(exc)) from None
    if not stopped:
        raise typer.Exit(code=code)


def _wait_until_answering(server: subprocess.Popen, url: str, *, deadline_s: float = 120.0) -> int | None:
    """Ask ``url`` until it answers: None once it does, or the server's exit code if it ends first.

    Raises:
        TimeoutError: neither within ``deadline_s``.
    """
    import time
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


def main() -> None:  # pragma: no cover - the `foldsweep` script and `python -m pipeline.cli`
    """Run the command, then leave without tearing the interpreter down (``processes.leave``)."""
    from pipeline.base.processes import leave

    try:
        app()
    except SystemExit as exc:  # click ends every command by raising it, its exit code inside
        leave(exc.code)
    leave(0)


if __name__ == "__main__":  # pragma: no cover
    main()
