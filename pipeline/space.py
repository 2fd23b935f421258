"""The search space: spec entries and hypermodel hyperparameters -> Ray Tune domains, in one place.

Names in ``search.space`` are either training hyperparameters that foldsweep applies itself
(``TRAINING_DEFAULTS``) or hyperparameters that the experiment's ``build(hp)`` asks for; a spec
entry overrides the range the hypermodel declared. Hypermodel hyperparameters the spec does not
mention are searched over the range the hypermodel declares.
"""

from __future__ import annotations

from typing import Any, Mapping

import keras_tuner
from keras_tuner.src.engine.hyperparameters import hp_types
from ray import tune

from pipeline.errors import SpecError
from pipeline.spec import TRAINING_DEFAULTS, ParamSpec, SweepSpec


def param_space(spec: SweepSpec, hyperparameters: keras_tuner.HyperParameters) -> dict[str, Any]:
    """The Ray Tune ``param_space`` of a sweep.

    Raises:
        SpecError: a ``search.space`` entry names neither a training hyperparameter nor one the
            experiment asks for.
    """
    discovered = {hp.name: hp for hp in hyperparameters.space}
    for name in spec.search.space:
        if name not in TRAINING_DEFAULTS and name not in discovered:
            known = sorted({*TRAINING_DEFAULTS, *discovered})
            raise SpecError(
                f"{spec.source_path}: search.space.{name} is not a hyperparameter of {spec.experiment} "
                f"(its build(hp) never asks for it) nor a training hyperparameter; known: {', '.join(known)}")
    space: dict[str, Any] = {name: value for name, value in TRAINING_DEFAULTS.items()}
    space.update({name: hp_domain(hp) for name, hp in discovered.items()})
    space.update({name: spec_domain(param) for name, param in spec.search.space.items()})
    return space


def spec_domain(param: ParamSpec) -> Any:
    """A spec entry as a Ray Tune domain; integer bounds in the spec are inclusive."""
    kind, args = param.kind, param.args
    if kind == "fixed":
        return args[0]
    if kind == "choice":
        return tune.choice(list(args))
    if kind == "grid":
        return tune.grid_search(list(args))
    if kind == "uniform":
        return tune.uniform(*args)
    if kind == "loguniform":
        return tune.loguniform(*args)
    if kind == "randint":
        return tune.randint(args[0], args[1] + 1)
    if kind == "qrandint":
        return tune.qrandint(*args)
    raise AssertionError(f"unhandled parameter kind {kind}")


def hp_domain(hp: Any) -> Any:
    """A KerasTuner hyperparameter as the Ray Tune domain that samples the same values."""
    if isinstance(hp, hp_types.Fixed):
        return hp.value
    if isinstance(hp, hp_types.Boolean):
        return tune.choice([True, False])
    if isinstance(hp, hp_types.Choice):
        return tune.choice(list(hp.values))
    if isinstance(hp, (hp_types.Int, hp_types.Float)):
        if hp.step is not None:
            # KerasTuner steps count from min_value (and multiply on a log scale), which Ray's
            # q-domains do not: enumerate the exact values instead.
            return tune.choice([_tidy(value) for value in hp.values])
        if isinstance(hp, hp_types.Int):
            sampler = tune.lograndint if hp.sampling == "log" else tune.randint
            return sampler(hp.min_value, hp.max_value + 1)
        sampler = tune.loguniform if hp.sampling == "log" else tune.uniform
        return sampler(hp.min_value, hp.max_value)
    raise SpecError(f"hyperparameter {hp.name!r} has a type foldsweep cannot search: {type(hp).__name__}")


def _tidy(value: Any) -> Any:
    # Stepped floats are accumulated sums (0.1 * 3 = 0.30000000000000004): record what was meant.
    return round(value, 10) if isinstance(value, float) else value


def split_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A trial's config as (training hyperparameters, model hyperparameters)."""
    training = {name: config.get(name, default) for name, default in TRAINING_DEFAULTS.items()}
    model = {name: value for name, value in config.items() if name not in TRAINING_DEFAULTS}
    return training, model
