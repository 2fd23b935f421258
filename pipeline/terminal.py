"""What the commands print, and how: the consoles (standard output at a log's width off a
terminal, standard error; no markup), a line said whole or a sentence told wrapped, an error,
the status line of what a command is doing, a checked spec's notice and warnings, what a sweep
tells as it runs (``SweepPrinter``) and what a trial run here tells (``TrialPrinter``), and what
``run`` and ``report`` both print of a sweep.
What is printed is made where the work is (``records.report``, ``rerun``, ``checks``...); this
module only prints it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from pipeline.records.ui_server import DEFAULT_UI_PORT

if TYPE_CHECKING:
    from pipeline.records.tracking import TrialRecord
    from pipeline.sweep import SweepEvents, SweepStart

# Captured output (CI logs, pipes) gets room for the leaderboard's columns. No markup: what is
# printed holds a researcher's values and messages, whose brackets ("[low, high]") rich would
# take for styles and drop; the few styled words are Text.
console = Console(width=None if sys.stdout.isatty() else 150, markup=False)
errors = Console(stderr=True, markup=False)


def styled(label: str, style: str, rest: str = "") -> Text:
    """``label`` in ``style``, then ``rest`` as it is."""
    return Text.assemble((label, style), rest)


def say(line: str | Text, *, style: str | None = None) -> None:
    """A line whole, however long: the terminal wraps it (a command, a row of figures)."""
    console.print(line, style=style, highlight=False, soft_wrap=True)


def tell(sentence: str | Text, *, style: str | None = None) -> None:
    """A sentence, wrapped at the console's width."""
    console.print(sentence, style=style, highlight=False)


def complain(message: str) -> None:
    """``error: message`` on standard error."""
    errors.print(styled("error:", "bold red", f" {message}"), highlight=False, soft_wrap=True)


class StatusLine:
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
        say(line, style="dim")

    def done(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def print_warnings(prepared: Any, *, num_samples_source: str = "search.num_samples") -> None:
    """A checked spec's notice (a space with fewer distinct configs than trials asked for) and, on
    standard error, its warnings."""
    notice = prepared.space.repeats_notice(prepared.num_samples, source=num_samples_source)
    if notice:
        say(styled("notice:", "yellow", f" {notice}"))
    for warning in prepared.warnings:
        errors.print(styled("warning:", "yellow", f" {warning}"), highlight=False, soft_wrap=True)


def print_leaderboard(standings: Any, name: str, tracking_uri: str) -> None:
    """A sweep's leaderboard, how many trials are tied with the best, and how to rerun the best."""
    from pipeline.base.environment import program_name
    from pipeline.records.report import leaderboard_table, rerun_command

    console.print(leaderboard_table(standings, title=f"{name}: leaderboard"))
    if standings.ties_line():
        say(standings.ties_line())
    command = rerun_command(standings, tracking_uri, program=program_name())
    if command:
        say(Text.assemble("rerun the best trial: ", (command, "bold")))


def print_sweep_time(account: Any, records: Any) -> None:
    """Where a sweep's wall clock went, and the share of its trials' that went to compiling."""
    from pipeline.records.report import compile_share_text, sweep_account_text

    if account is not None:
        say(f"where the sweep's time went: {sweep_account_text(account)}")
    line = compile_share_text(records)
    if line:
        say(line)


def print_refit_model(tags: Any, tracking_uri: str) -> None:
    """The refit's logged model and how to load and serve it, by this environment's python and
    mlflow (named by their directory where they are not the ones on the PATH)."""
    from pipeline.base.environment import programs_off_path
    from pipeline.records.report import refit_model_lines

    for line in refit_model_lines(tags, tracking_uri, tools=programs_off_path()):
        say(line)


def print_ui_address(tracking_uri: str, ui_path: str, *, sweep: str, port: int = DEFAULT_UI_PORT) -> None:
    """The command that opens the MLflow UI on a sweep, and its address (``ui_path``) there."""
    from pipeline.records.ui_server import ui_command

    command = (ui_command(tracking_uri, sweep=sweep), "bold")
    say(Text.assemble("Open the MLflow UI on this sweep: ", command, f" then browse http://127.0.0.1:{port}{ui_path}"))


class SweepPrinter:
    """How `run` prints what its sweep tells as it runs (``pipeline.sweep.SweepEvents``): what it
    is doing meanwhile on the status line; once checked, the sweep it resumes, its plan, notice
    and warnings; then its progress (``sweep_progress``) and each trial's line once recorded.
    ``close`` ends the status line and the progress, however the sweep ended."""

    def __init__(self, *, num_samples_source: str) -> None:
        self.num_samples_source = num_samples_source  # what set the trials asked for, as the notice names it
        self.status = StatusLine()
        self.progress: Any = None
        self.objective_key = ""

    def events(self) -> SweepEvents:
        from pipeline.sweep import SweepEvents

        return SweepEvents(
            starting=self.starting,
            trial_done=self.trial_done,
            notify=lambda line: tell(line, style="yellow"),
            say=self.status.say,
            doing=self.status,
        )

    def starting(self, start: SweepStart) -> Any:
        from pipeline.sweep import sweep_progress

        prepared = start.prepared
        name = prepared.spec.name
        self.status.done()
        if start.resumes is not None:
            tell(
                f"resuming sweep {name} (run {start.resumes}): {start.done_before} of {prepared.trial_count} trials done"
            )
        tell(Text.assemble("sweep ", (name, "bold"), f": {prepared.sweep_plan()}"))
        print_warnings(prepared, num_samples_source=self.num_samples_source)
        self.objective_key = prepared.spec.objective.key
        self.progress = sweep_progress(
            prepared, done_before=start.done_before, console=console, live=sys.stdout.isatty()
        )
        return self.progress

    def trial_done(self, record: TrialRecord) -> None:
        from pipeline.records.report import trial_line

        self.progress.trial_recorded(record)
        tell(trial_line(record, self.objective_key))

    def close(self) -> None:
        self.status.done()
        if self.progress is not None:
            self.progress.close()


class TrialPrinter:
    """How `trial` and `rerun` print what the trial tells as it runs (``pipeline.rerun.TrialOutput``)."""

    checked = staticmethod(print_warnings)
    say = staticmethod(say)
    tell = staticmethod(tell)

    def note(self, note: str) -> None:
        say(styled("note:", "yellow", f" {note}"))

    def caution(self, line: str) -> None:
        say(line, style="yellow")

    def non_finite(self, description: str) -> None:
        say(styled("first non-finite value:", "bold red", f" {description}"))
