"""The search space: spec entries and hypermodel hyperparameters -> Ray Tune domains, in one place.

Names in ``search.space`` are either training hyperparameters that foldsweep applies itself
(``TRAINING_DEFAULTS``) or hyperparameters that the experiment's ``build(hp)`` asks for; a spec
entry overrides the range the hypermodel declared. Hypermodel hyperparameters the spec does not
mention are searched over the range the hypermodel declares.

Some hyperparameters only count under a condition: ``clip_threshold`` when ``clipping`` is not
``none`` (``TRAINING_CONDITIONS``), and a hypermodel hyperparameter declared in a KerasTuner
conditional scope when its parent has one of the scope's values. ``resolve_config`` turns a sampled config into the values
a trial actually uses (and records); Optuna is given a define-by-run space that does not even
suggest the inactive ones.

Two sampled configs that resolve to the same values are the same config, and no sweep trains one
twice: ``SearchSpace.trial_count`` counts the distinct configs a sweep can draw, and
``SearchSpace.draw`` draws Ray Tune's variants without repeating one.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import keras_tuner
from keras_tuner.src.engine import conditions as conditions_module
from keras_tuner.src.engine.hyperparameters import hp_types
from ray import tune
from ray.tune.search import sample

from pipeline.base.errors import SpecError
from pipeline.inputs.spec import CLIPPING_ARGUMENTS, NO_CLIPPING, TRAINING_DEFAULTS, ParamSpec, SweepSpec

# A grid over (clipping, clip_threshold) pairs is one config key, so that `none` is not repeated
# once per threshold.
CLIP_PAIR = "clipping+threshold"
# What a hypermodel that compiles its own optimizer decides itself, unless the spec names it.
OWN_OPTIMIZER_SETTINGS = ("optimizer", "learning_rate")
# Training hyperparameters that only count under a condition, as KerasTuner conditions: the same
# rule as a hypermodel's conditional scopes, so one mechanism drops, records and suggests both.
TRAINING_CONDITIONS: Mapping[str, tuple[Any, ...]] = {
    "clip_threshold": (conditions_module.Parent("clipping", list(CLIPPING_ARGUMENTS)),),
}
# A random search draws again where Ray Tune's draw repeats a config (so a sweep that met no
# repeat draws exactly as Ray Tune does). A config that is rarely drawn (the top value of a
# log-uniform integer) could keep a space's last few configs from being met for long: after this
# many rounds of draws per sample, the configs still wanted are taken in order.
ROUNDS_PER_SAMPLE = 10


@dataclass(frozen=True)
class SearchSpace:
    """What the Tuner samples, and how to read a sampled config back."""

    param_space: dict[str, Any]
    conditions: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    domains: Mapping[str, Any] = field(default_factory=dict)

    # The trials each grid point runs, by num_samples: counted once (counting walks the space).
    _quotas: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def trial_count(self, num_samples: int) -> int:
        """Trials a sweep runs: ``num_samples`` configs at every grid point (Ray Tune's semantics),
        but never one config twice: where fewer distinct configs remain, each runs once."""
        return sum(self._quotas_of(num_samples).values())

    def repeats_notice(self, num_samples: int, *, source: str = "search.num_samples") -> str | None:
        """What a researcher should know when the space has fewer distinct configs than asked for."""
        points = len(self._quotas_of(num_samples))
        trials = self.trial_count(num_samples)
        if trials == points * num_samples:
            return None
        if points == 1:
            return (
                f"{source} {num_samples} exceeds the {trials} distinct configs of the search space: each runs "
                f"once ({trials} trials); search.algorithm: grid enumerates them"
            )
        if num_samples == 1:
            return (
                f"the {points} grid points make {trials} distinct configs (where a grid hyperparameter does not "
                f"apply, as a clip_threshold without clipping, its values make one config): each runs once"
            )
        return (
            f"{source} {num_samples} at each of the {points} grid points would repeat configs: they make "
            f"{trials} distinct ones, and each runs once ({trials} trials, not {points * num_samples})"
        )

    def draw(self, spec: dict[str, Any], *, num_samples: int, random_state: Any) -> list[tuple[dict, dict]]:
        """Ray Tune's variants of an experiment ``spec`` (resolved vars, resolved spec) for
        ``num_samples``: Ray Tune's own draws from ``random_state``, in its order, but a config drawn
        before is drawn again, until every grid point has its ``trial_count`` share."""
        from ray.tune.search.variant_generator import generate_variants

        wanted = dict(self._quotas_of(num_samples))
        taken: set[str] = set()
        drawn: list[tuple[dict, dict]] = []

        def take(point: tuple[int, ...], resolved: dict[str, Any], variant: tuple[dict, dict]) -> None:
            taken.add(config_key(resolved))
            wanted[point] -= 1
            drawn.append(variant)

        rounds = 0
        while any(wanted.values()):
            if rounds == ROUNDS_PER_SAMPLE * num_samples:
                for point in [point for point, count in wanted.items() if count]:
                    for resolved in self._configs_at(point):
                        if wanted[point] and config_key(resolved) not in taken and not _stands_for_many(resolved):
                            take(point, resolved, _variant_of(spec, resolved))
            rounds += 1
            for resolved_vars, variant_spec in generate_variants(spec, random_state=random_state):
                config = variant_spec["config"]
                point = self._point_of(config)
                resolved = self.resolve(config)
                if wanted[point] and config_key(resolved) not in taken and self._owner(resolved) == point:
                    take(point, resolved, (resolved_vars, variant_spec))
        return drawn

    def largest_value(self, name: str) -> Any:
        """The largest value a numeric hyperparameter can take (None for unknown names)."""
        domain = self.domains.get(name)
        if domain is None:
            return None
        if isinstance(domain, sample.Integer):
            return domain.upper - (0 if isinstance(domain.get_sampler(), sample.Quantized) else 1)
        if isinstance(domain, sample.Float):
            return domain.upper
        return max(_values(domain))

    def searched(self) -> list[str]:
        """The names whose value differs between trials (a distribution or a grid), in order."""
        return [name for name, domain in self.domains.items() if isinstance(domain, (sample.Domain, dict))]

    def resolve(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return resolve_config(config, self.conditions)

    def optuna_define_by_run(self) -> Callable[[Any], dict[str, Any]]:
        """Optuna's define-by-run space: suggests only what is active given earlier answers."""
        return _OptunaSpace(dict(self.domains), dict(self.conditions))

    def untried(self, tried: Container[str]) -> dict[str, Any] | None:
        """The searched values of the first config whose ``config_key`` is not in ``tried`` (of a
        space without grid entries; a continuous hyperparameter left out), None when all were."""
        searched = self.searched()
        for resolved in self._configs_at(()):
            if _stands_for_many(resolved) or config_key(resolved) not in tried:
                return {
                    name: value
                    for name, value in resolved.items()
                    if name in searched and not isinstance(value, sample.Domain)
                }
        return None

    def _grids(self) -> dict[str, list[Any]]:
        return {name: domain["grid_search"] for name, domain in self.param_space.items() if _is_grid(domain)}

    def _quotas_of(self, num_samples: int) -> dict[tuple[int, ...], int]:
        """Each grid point (its values' indices) with the distinct configs it runs: up to
        ``num_samples`` of those it owns."""
        if num_samples not in self._quotas:
            points = itertools.product(*(range(len(values)) for values in self._grids().values()))
            self._quotas[num_samples] = {point: _at_most(num_samples, self._configs_at(point)) for point in points}
        return self._quotas[num_samples]

    def _point_of(self, config: Mapping[str, Any]) -> tuple[int, ...]:
        return tuple(values.index(config[name]) for name, values in self._grids().items())

    def _owner(self, resolved: Mapping[str, Any]) -> tuple[int, ...]:
        """The first grid point that makes ``resolved``: where a grid hyperparameter does not apply
        (a threshold without clipping), every one of its grid values makes the same config."""
        return tuple(
            next(index for index, value in enumerate(values) if _agrees(name, value, resolved))
            for name, values in self._grids().items()
        )

    def _configs_at(self, point: tuple[int, ...]) -> Iterator[dict[str, Any]]:
        """The distinct resolved configs that grid ``point`` owns, in order: every combination of
        the values its sampled hyperparameters can take where they apply; a continuous one stays
        its domain (which stands for endlessly many configs)."""
        conditions = {**TRAINING_CONDITIONS, **self.conditions}
        parents = {condition.name for rules in conditions.values() for condition in rules}
        fixed = {name: domain for name, domain in self.param_space.items() if not isinstance(domain, sample.Domain)}
        fixed.update({name: values[index] for (name, values), index in zip(self._grids().items(), point)})
        sampled = _parents_first([name for name in self.param_space if name not in fixed], conditions)
        seen: set[str] = set()

        def combinations(index: int, config: dict[str, Any]) -> Iterator[dict[str, Any]]:
            if index == len(sampled):
                yield config
                return
            name = sampled[index]
            domain = self.param_space[name]
            values = _finite_values(domain)
            applies = all(condition.is_active(config_values(config)) for condition in conditions.get(name, ()))
            # One value stands for all where the hyperparameter does not apply, unless another one's
            # condition reads it.
            for value in [domain] if values is None else values if applies or name in parents else values[:1]:
                yield from combinations(index + 1, {**config, name: value})

        for config in combinations(0, fixed):
            resolved = self.resolve(config)
            key = config_key(resolved)
            if key not in seen and self._owner(resolved) == point:
                seen.add(key)
                yield resolved


def build_space(
    spec: SweepSpec,
    hyperparameters: keras_tuner.HyperParameters,
    *,
    default_epochs: int | None = None,
    own_optimizer: bool = False,
) -> SearchSpace:
    """The sweep's search space for its search algorithm.

    With ``own_optimizer`` (the hypermodel compiles its model), foldsweep's ``optimizer`` and
    ``learning_rate`` are in the space only where the spec names them: the compiled ones apply.

    Raises:
        SpecError: a ``search.space`` entry names neither a training hyperparameter nor one the
            experiment asks for; or a grid search meets a continuous hyperparameter.
    """
    discovered = {hp.name: hp for hp in hyperparameters.space}
    for name, condition in TRAINING_CONDITIONS.items():
        if name in discovered:
            (parent,) = condition
            raise SpecError(
                f"hyperparameter {name!r}: {spec.experiment} declares it, but foldsweep keeps that name for the "
                f"spec's gradient clipping and gives it to a trial only where {parent.name} is on: elsewhere the "
                "build would train with its default, and the search would never vary it. Name it otherwise (e.g. "
                "clipnorm)"
            )
    for name in spec.search.space:
        if name not in TRAINING_DEFAULTS and name not in discovered:
            known = sorted({*TRAINING_DEFAULTS, *discovered})
            raise SpecError(
                f"{spec.source_path}: search.space.{name} is not a hyperparameter of {spec.experiment} "
                f"(its build(hp) never asks for it) nor a training hyperparameter; known: {', '.join(known)}"
            )
    domains: dict[str, Any] = dict(TRAINING_DEFAULTS)
    if own_optimizer:
        for name in OWN_OPTIMIZER_SETTINGS:
            domains.pop(name)
    domains["epochs"] = default_epochs if default_epochs is not None else spec.train.epochs
    # In the hypermodel's order, a name the spec names in its place: the order is the searchers'
    # (a seed draws the same configs only from the same order).
    domains.update(
        {
            name: spec_domain(spec.search.space[name])
            if name in spec.search.space
            else hp_domain(hp, declared_in=spec.experiment)
            for name, hp in discovered.items()
        }
    )
    domains.update({name: spec_domain(param) for name, param in spec.search.space.items()})
    conditions = {
        **TRAINING_CONDITIONS,
        **{name: tuple(hp.conditions) for name, hp in discovered.items() if hp.conditions},
    }

    if spec.search.algorithm == "grid":
        domains = {name: _as_grid(spec, name, domain) for name, domain in domains.items()}
    param_space = dict(domains)
    if spec.search.algorithm != "optuna" and _is_grid(domains["clipping"]) and _is_finite(domains["clip_threshold"]):
        param_space.pop("clipping")
        param_space.pop("clip_threshold")
        param_space[CLIP_PAIR] = tune.grid_search(
            _clip_pairs(_values(domains["clipping"]), _values(domains["clip_threshold"]))
        )
    return SearchSpace(param_space=param_space, conditions=conditions, domains=domains)


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


def hp_domain(hp: Any, *, declared_in: str = "the hypermodel") -> Any:
    """A KerasTuner hyperparameter (of the hypermodel ``declared_in`` names) as the Ray Tune domain
    that samples the same values."""
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
        if hp.sampling == "reverse_log":
            kind = type(hp).__name__
            raise SpecError(
                f"hyperparameter {hp.name!r}: {declared_in} declares it hp.{kind}({hp.min_value}, {hp.max_value}, "
                "sampling='reverse_log'), its draws crowding toward the top of the range, which no Ray Tune search "
                "space draws: give it a step (its values are then searched as a choice), or name it in the spec's "
                f"search.space (e.g. {hp.name}: {{uniform: [{hp.min_value}, {hp.max_value}]}})"
            )
        if isinstance(hp, hp_types.Int):
            sampler = tune.lograndint if hp.sampling == "log" else tune.randint
            return sampler(hp.min_value, hp.max_value + 1)
        sampler = tune.loguniform if hp.sampling == "log" else tune.uniform
        return sampler(hp.min_value, hp.max_value)
    raise SpecError(f"hyperparameter {hp.name!r} has a type foldsweep cannot search: {type(hp).__name__}")


def _tidy(value: Any) -> Any:
    # Stepped floats are accumulated sums (0.1 * 3 = 0.30000000000000004): record what was meant.
    return round(value, 10) if isinstance(value, float) else value


def _is_grid(domain: Any) -> bool:
    return isinstance(domain, dict) and "grid_search" in domain


def _is_finite(domain: Any) -> bool:
    return _is_grid(domain) or isinstance(domain, sample.Categorical) or not isinstance(domain, sample.Domain)


def _finite_values(domain: Any) -> list[Any] | None:
    """Every value a sampled domain can draw, as Ray Tune draws them; None for a continuous one."""
    if isinstance(domain, sample.Categorical):
        return list(domain.categories)
    if not isinstance(domain, sample.Integer):
        return None
    sampler = domain.get_sampler()
    if isinstance(sampler, sample.Quantized):
        # Ray Tune draws multiples of q between the bounds, both included unless q is 1.
        q = sampler.q
        lower, upper = -(-domain.lower // q), domain.upper // q + (0 if q == 1 else 1)
        return [index * q for index in range(lower, upper)]
    return list(range(domain.lower, domain.upper))


def _at_most(count: int, configs: Iterator[dict[str, Any]]) -> int:
    """How many ``configs`` there are, up to ``count``; one that stands for many fills it."""
    found = 0
    for config in configs:
        found = count if _stands_for_many(config) else found + 1
        if found >= count:
            break
    return found


def _stands_for_many(resolved: Mapping[str, Any]) -> bool:
    return any(isinstance(value, sample.Domain) for value in resolved.values())


def config_key(resolved: Mapping[str, Any]) -> str:
    """What tells resolved configs apart: two with equal keys are the same config."""
    return repr(sorted(resolved.items()))


def _agrees(name: str, value: Any, resolved: Mapping[str, Any]) -> bool:
    """Whether grid ``value`` of ``name`` can have made ``resolved`` (a clipping pair is two values)."""
    values = value if name == CLIP_PAIR else {name: value}
    return all(key not in resolved or resolved[key] == wanted for key, wanted in values.items())


def _parents_first(names: list[str], conditions: Mapping[str, tuple[Any, ...]]) -> list[str]:
    """``names`` in order, but each after the ones its conditions read."""

    def depth(name: str) -> int:
        return 1 + max(
            (depth(condition.name) for condition in conditions.get(name, ()) if condition.name in names), default=0
        )

    return sorted(names, key=depth)


def _variant_of(spec: dict[str, Any], resolved: dict[str, Any]) -> tuple[dict, dict]:
    """A resolved config as Ray Tune's variant of ``spec`` (resolved vars, resolved spec)."""
    variant = copy.deepcopy(spec)
    variant["config"] = dict(resolved)
    searched = [name for name, domain in spec["config"].items() if isinstance(domain, (sample.Domain, dict))]
    return {("config", name): resolved[name] for name in searched if name in resolved}, variant


def _values(domain: Any) -> list[Any]:
    if _is_grid(domain):
        return list(domain["grid_search"])
    if isinstance(domain, sample.Categorical):
        return list(domain.categories)
    return [domain]


def _as_grid(spec: SweepSpec, name: str, domain: Any) -> Any:
    if _is_grid(domain) or not isinstance(domain, sample.Domain):
        return domain
    if isinstance(domain, sample.Categorical):
        return tune.grid_search(list(domain.categories))
    if isinstance(domain, sample.Integer) and not isinstance(domain.get_sampler(), sample.Quantized):
        return tune.grid_search(list(range(domain.lower, domain.upper)))
    raise SpecError(
        f"{spec.source_path}: search.algorithm grid needs finite values, but hyperparameter {name!r} of "
        f"{spec.experiment} is continuous; fix it in search.space (a value, choice or grid)"
    )


def _clip_pairs(kinds: list[Any], thresholds: list[Any]) -> list[dict[str, Any]]:
    pairs: list[dict[str, Any]] = []
    for kind, threshold in itertools.product(kinds, thresholds):
        active = all(condition.is_active({"clipping": kind}) for condition in TRAINING_CONDITIONS["clip_threshold"])
        pair = {"clipping": kind, "clip_threshold": threshold if active else None}
        if pair not in pairs:
            pairs.append(pair)
    return pairs


def config_values(config: Mapping[str, Any]) -> dict[str, Any]:
    """Every value of a sampled config, clipping pairs unpacked, none dropped."""
    values = {key: value for key, value in config.items() if key != CLIP_PAIR}
    values.update(config.get(CLIP_PAIR) or {})
    values.setdefault("clipping", NO_CLIPPING)
    return values


def resolve_config(config: Mapping[str, Any], conditions: Mapping[str, tuple[Any, ...]] = {}) -> dict[str, Any]:
    """The values a trial uses: clipping pairs unpacked, and hyperparameters whose condition is
    inactive dropped (the threshold when clipping is off, a hypermodel's conditional scopes)."""
    values = config_values(config)
    conditions = {**TRAINING_CONDITIONS, **conditions}
    return {
        key: value
        for key, value in values.items()
        if all(condition.is_active(values) for condition in conditions.get(key, ()))
    }


def split_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A resolved config as (training hyperparameters, the values a build(hp) gets).

    The build gets every value: a hypermodel that asks for ``learning_rate`` or ``optimizer``
    itself (to compile its model) gets the trial's, and it ignores the names it never asks for.
    """
    training = {name: config.get(name, default) for name, default in TRAINING_DEFAULTS.items()}
    return training, dict(config)


class _OptunaSpace:
    """A picklable define-by-run function over Ray Tune domains (see ``optuna_define_by_run``)."""

    def __init__(self, domains: dict[str, Any], conditions: dict[str, tuple[Any, ...]]):
        from ray.tune.search.optuna import OptunaSearch

        self.constants = {name: value for name, value in domains.items() if not isinstance(value, sample.Domain)}
        # Converted once here, not at every suggestion; the order of `domains` is kept so that a
        # parent (clipping, a conditional scope's Choice) is answered before what depends on it.
        searched = {name: value for name, value in domains.items() if isinstance(value, sample.Domain)}
        self.distributions = OptunaSearch.convert_search_space(searched) if searched else {}
        self.order = list(domains)
        self.conditions = conditions

    def __call__(self, trial: Any) -> dict[str, Any]:
        values: dict[str, Any] = {}
        constants: dict[str, Any] = {}
        for name in self.order:
            known = {**constants, **values}
            if not all(condition.is_active(known) for condition in self.conditions.get(name, ())):
                continue
            if name in self.constants:
                constants[name] = self.constants[name]
            else:
                values[name] = _suggest(trial, name, self.distributions[name])
        return constants


def _suggest(trial: Any, name: str, distribution: Any) -> Any:
    import optuna

    if isinstance(distribution, optuna.distributions.CategoricalDistribution):
        return trial.suggest_categorical(name, distribution.choices)
    if isinstance(distribution, optuna.distributions.IntDistribution):
        return trial.suggest_int(
            name, distribution.low, distribution.high, step=distribution.step, log=distribution.log
        )
    return trial.suggest_float(name, distribution.low, distribution.high, step=distribution.step, log=distribution.log)
