"""Experiments: load a researcher's KerasTuner hypermodel and build it for one trial.

The contract is KerasTuner's: ``build(hp) -> keras.Model`` as a plain function, or a
``keras_tuner.HyperModel`` (class or instance). foldsweep never asks the researcher to change it:
the space is discovered by building once with a fresh ``HyperParameters``, and a trial builds
with a ``HyperParameters`` whose values are pre-set, which KerasTuner returns instead of defaults.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import keras
import keras_tuner
from keras_tuner.src.engine.hyperparameters import hp_types

from pipeline.errors import ExperimentError


@dataclass(frozen=True)
class Experiment:
    """A loaded hypermodel and the hyperparameters its build asked for."""

    reference: str
    build_fn: Callable[[keras_tuner.HyperParameters], Any]
    hyperparameters: keras_tuner.HyperParameters
    input_shape: tuple[int | None, ...]
    output_units: int

    def build(self, values: Mapping[str, Any]) -> keras.Model:
        return build_model(self.build_fn, values)


def build_model(build_fn: Callable[[keras_tuner.HyperParameters], Any], values: Mapping[str, Any]) -> keras.Model:
    """Build with the given hyperparameter values; names the values leave unset take defaults."""
    hp = keras_tuner.HyperParameters()
    hp.values = dict(values)
    return build_fn(hp)


def load_experiment(path: Path, attr: str, *, reference: str | None = None) -> Experiment:
    """Import the experiment file, find its builder and build it once to discover its space.

    Raises:
        ExperimentError: missing file, import failure, no such builder, build raising or
            returning something that is not a Keras model.
    """
    reference = reference or f"{path}:{attr}"
    build_fn = load_builder(path, attr, reference=reference)
    hp = keras_tuner.HyperParameters()
    model = _checked_build(build_fn, hp, reference, "default hyperparameters")
    input_shape = tuple(model.inputs[0].shape[1:]) if model.inputs else ()
    output_units = int(model.outputs[0].shape[-1]) if model.outputs else 0
    _discover_conditional(build_fn, hp, reference)
    keras.backend.clear_session()
    return Experiment(reference, build_fn, hp, input_shape, output_units)


MAX_DISCOVERY_BUILDS = 64


def _discover_conditional(build_fn: Callable[[Any], Any], space: keras_tuner.HyperParameters, reference: str) -> None:
    """Grow ``space`` with hyperparameters that only the other branches of a choice ask for.

    A build with defaults registers only the hyperparameters on the default path; those in a
    conditional scope of another value of a Choice or Boolean appear only when that value is
    taken. Each such value is built once, until no build adds a name. A branch that fails to
    build is skipped here: it fails its own trials, which the sweep records, as KerasTuner would.
    """
    tried: set[tuple[str, Any]] = set()
    for _ in range(MAX_DISCOVERY_BUILDS):
        untried = [(hp.name, value) for hp in space.space if isinstance(hp, (hp_types.Choice, hp_types.Boolean))
                   for value in _choice_values(hp) if (hp.name, value) not in tried]
        if not untried:
            return
        name, value = untried[0]
        tried.add((name, value))
        branch = keras_tuner.HyperParameters()
        branch.values = {name: value}
        try:
            build_fn(branch)
        except Exception:
            continue
        space.merge([hp for hp in branch.space if not space._exists(hp.name, hp.conditions)])


def _choice_values(hp: Any) -> list[Any]:
    return [True, False] if isinstance(hp, hp_types.Boolean) else list(hp.values)


def _checked_build(build_fn: Callable[[Any], Any], hp: keras_tuner.HyperParameters, reference: str,
                   with_what: str) -> keras.Model:
    try:
        model = build_fn(hp)
    except Exception as exc:
        raise ExperimentError(
            f"experiment: {reference} raised {type(exc).__name__} when built with {with_what}: "
            f"{exc}\n{_last_frame(exc)}") from None
    if not isinstance(model, keras.Model):
        raise ExperimentError(
            f"experiment: {reference} must return a keras.Model, got {type(model).__name__}")
    return model


def load_builder(path: Path, attr: str, *, reference: str | None = None) -> Callable[[Any], Any]:
    """Import the experiment file and return its build(hp) callable (no build, no discovery)."""
    reference = reference or f"{path}:{attr}"
    if not path.is_file():
        raise ExperimentError(f"experiment: file not found: {str(path)!r} (from {reference!r})")
    module_name = f"foldsweep_experiment_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    # The experiment's own directory goes on the path so that it can import its neighbours.
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise ExperimentError(
            f"experiment: importing {str(path)!r} failed: {type(exc).__name__}: {exc}\n{_last_frame(exc)}") from None
    finally:
        sys.path.pop(0)
    if not hasattr(module, attr):
        found = sorted(name for name, value in vars(module).items() if callable(value) and not name.startswith("_"))
        raise ExperimentError(
            f"experiment: {str(path)!r} has no {attr!r}; callables found: {', '.join(found) or 'none'}")
    target = getattr(module, attr)
    if isinstance(target, type) and issubclass(target, keras_tuner.HyperModel):
        try:
            target = target()
        except Exception as exc:
            raise ExperimentError(f"experiment: {reference}: cannot instantiate the HyperModel: {exc}") from None
    if isinstance(target, keras_tuner.HyperModel):
        return target.build
    if not callable(target):
        raise ExperimentError(f"experiment: {reference} must be a build(hp) function or a keras_tuner.HyperModel, "
                              f"got {type(target).__name__}")
    return target


def _last_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    return f"  at {frame.filename}:{frame.lineno}: {frame.line}"
