"""The ``foldsweep`` command: parse arguments, call the pipeline, map failures to exit codes.

Exit codes: 0 the command did its job (a sweep whose trials partly failed still completed),
2 bad input (spec, data, experiment, URI), 1 an internal error, 130 interrupted; ``foldsweep ui``
exits with the MLflow server's own code where the server ends before answering.
"""

from __future__ import annotations

import functools
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from pipeline.base.errors import FoldsweepError
from pipeline.base.quiet import quiet_environment
from pipeline.base.read_ahead import start_read_ahead
from pipeline.inputs.spec import TrackingSpec
from pipeline.records.ui_server import DEFAULT_UI_PORT
from pipeline.terminal import (
    SweepPrinter,
    TrialPrinter,
    complain,
    console,
    errors,
    print_leaderboard,
    print_refit_model,
    print_sweep_time,
    print_ui_address,
    print_warnings,
    say,
    styled,
    tell,
)

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
TrackingUriOption = typer.Option(
    None, "--tracking-uri", help=f"MLflow tracking URI [default: the spec's tracking.uri, or {TrackingSpec.uri}]"
)
# The store of the commands that read one: the spec's default store.
StoreOption = typer.Option(TrackingSpec.uri, "--tracking-uri", help="MLflow tracking URI")


def exit_codes(command: Callable[..., Any]) -> Callable[..., Any]:
    """Bad input -> one message and exit 2; foldsweep's own other errors -> one message and their
    ``exit_code`` (1, or the UI server's own: ``ServerEnded``); anything unexpected -> traceback
    and exit 1."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except FoldsweepError as exc:  # bad input, or not the input's fault yet nothing a traceback would explain
            complain(str(exc))
            raise typer.Exit(code=exc.exit_code) from None
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
    start_read_ahead()
    from pipeline.checks import prepare_driver
    from pipeline.inputs.spec import load_spec

    prepared = prepare_driver(load_spec(spec))  # as a sweep's driver checks it
    tell(styled("ok", "green", f" {spec}: {prepared.summary()}"))
    for line in prepared.notes():
        tell(line)
    tell(prepared.stacking_note())
    print_warnings(prepared)


@app.command()
@exit_codes
def datasets() -> None:
    """List the built-in datasets with their shapes and sizes (generating any not yet cached)."""
    from rich.table import Table

    from pipeline.inputs.datasets import builtin_summaries, data_dir_source

    rows = builtin_summaries()
    table = Table(title="built-in datasets (default options)")
    for column in rows[0]:
        table.add_column(column)
    for row in rows:
        table.add_row(*row.values())
    console.print(table)
    say(f"built-in datasets are cached in {data_dir_source()}")


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
    start_read_ahead()
    from pipeline.sweep import SweepInterrupted, sweep_of_spec

    printer = SweepPrinter(num_samples_source="--num-samples" if num_samples else "search.num_samples")
    try:
        ended = sweep_of_spec(
            spec,
            printer.events(),
            tracking_uri=tracking_uri,
            num_samples=num_samples,
            address=address,
            resume=resume,
            register_model=register_model,
            model_alias=model_alias,
            started_at=started_at,
        )
    except SweepInterrupted as interrupted:
        from pipeline.base.environment import program_name

        again = " ".join([program_name(), *(shlex.quote(arg) for arg in sys.argv[1:] if arg != "--resume")])
        errors.print(
            f"interrupted: sweep run {interrupted.parent_run_id} stopped, unfinished trials marked KILLED. "
            f"Resume with: {again} --resume",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(code=130) from None
    finally:
        printer.close()
    prepared, outcome = ended.start.prepared, ended.outcome
    name, tracking = prepared.spec.name, prepared.tracking_uri
    print_leaderboard(ended.standings, name, tracking)
    tell(ended.trained_line())
    print_sweep_time(outcome.account, outcome.records)
    print_refit_model(outcome.refit_tags, tracking)
    print_ui_address(tracking, outcome.ui_path, sweep=name)
    for what in ended.failed:
        complain(f"every trial ended and is recorded, but {what}")
    if ended.failed:
        raise typer.Exit(code=1)


@app.command()
@exit_codes
def report(
    sweep: str | None = typer.Argument(None, help="Sweep name or parent run id [default: the latest sweep]"),
    tracking_uri: str = StoreOption,
) -> None:
    """Print a recorded sweep's leaderboard, NaN and throughput tables; refresh its plots,
    descriptions and its view in the MLflow UI."""
    from pipeline.records.publish import report_sweep
    from pipeline.records.report import account_rows, account_table, nan_table_rows, rows_table, throughput_rows

    recorded = report_sweep(tracking_uri, sweep)
    parent, records = recorded.parent, recorded.records
    print_leaderboard(recorded.standings, parent.name, tracking_uri)
    console.print(rows_table(nan_table_rows(records), "NaN failures by batch size and clipping"))
    console.print(rows_table(throughput_rows(records), "throughput by batch size (medians)"))
    time_rows = account_rows(records)
    if time_rows:
        console.print(account_table(time_rows))
    print_sweep_time(recorded.account, records)
    if recorded.test_scores:
        scores = ", ".join(f"{key} {value:.4f}" for key, value in sorted(recorded.test_scores.items()))
        tell(f"refit on the held-out test split: {scores}")
    print_refit_model(parent.tags, tracking_uri)
    for line in recorded.environment:
        say(f"environment: {line}")
    ui_path = recorded.publish()
    tell(f"{len(records)} trials of sweep run {parent.run_id}; cv_results.csv, plots and descriptions refreshed on it.")
    print_ui_address(tracking_uri, ui_path, sweep=parent.name)


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
    start_read_ahead()
    from pipeline.rerun import TrialOptions, trial_of_spec

    options = TrialOptions(
        set_values=tuple(set_values),
        fold=fold,
        epochs=epochs,
        eager=eager,
        check_numerics=check_numerics,
        profile=profile,
        profile_epoch=profile_epoch,
        started=started,
    )
    trial_of_spec(spec, options, TrialPrinter())


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
    start_read_ahead()
    from pipeline.rerun import TrialOptions, rerun_recorded

    options = TrialOptions(
        set_values=tuple(set_values),
        fold=fold,
        epochs=epochs,
        eager=eager,
        check_numerics=check_numerics,
        profile=profile,
        profile_epoch=profile_epoch,
        started=started,
    )
    rerun_recorded(tracking_uri, run_id, options, TrialPrinter(), track=not no_track)


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
    from pipeline.records.ui_server import serve_ui

    def on_open(address: str) -> None:
        say(f"MLflow UI for {tracking_uri} at {address} (Ctrl-C stops it)")

    raise typer.Exit(code=serve_ui(tracking_uri, sweep=sweep, port=port, on_open=on_open))


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
