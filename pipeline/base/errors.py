"""The two failure levels of a sweep.

``InputError`` stops the command before anything runs (exit code 2): a bad spec, dataset,
experiment module or URI. Everything else that escapes a command is an internal error (exit 1).
A single trial that fails is not an exception at this level: Ray Tune records it and the sweep
goes on.
"""


class FoldsweepError(Exception):
    """Base class of foldsweep's own errors; a command that ends on one exits with ``exit_code``."""

    exit_code = 1


class InputError(FoldsweepError, ValueError):
    """The user's input is wrong; the message names the key or file, the rule and the value."""

    exit_code = 2


class SpecError(InputError):
    """The sweep spec breaks a rule."""


class DataError(InputError):
    """The dataset cannot be used as asked."""


class ExperimentError(InputError):
    """The experiment module (hypermodel) cannot be loaded or built."""


class TrackingError(InputError):
    """The tracking store cannot be used or does not hold what was asked for."""
