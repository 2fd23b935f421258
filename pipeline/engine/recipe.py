"""The training recipe: how every trial of a sweep turns its config into what the fold engines
train with: training hyperparameters, an optimizer (the build's own compile or foldsweep's, with
the spec's clipping) and a loss (the build's or foldsweep's, as ``train.*`` says).

The sweep's trials, ``foldsweep trial``/``rerun`` and the refit all take their recipe from one
``TrainingRecipe``, made from the spec by ``TrainingRecipe.from_spec``, so none can train a
config differently from the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import keras

from pipeline.base.keras_private import weight_decay_exclusions
from pipeline.contract.plan import ExecutionChoices
from pipeline.inputs.hypermodel import optimizer_config, remade_optimizer, schedule_text
from pipeline.inputs.losses import TrainingLoss, training_loss
from pipeline.inputs.space import resolve_config, split_config
from pipeline.inputs.spec import CLIPPING_ARGUMENTS, NO_CLIPPING, OPTIMIZERS, TRAINING_DEFAULTS, SweepSpec, TrainSpec


@dataclass(frozen=True)
class TrainingParams:
    batch_size: int
    learning_rate: float
    optimizer: str
    clipping: str = NO_CLIPPING
    clip_threshold: float | None = None
    shuffle: bool = True


def optimizer_class(name: str) -> type[keras.optimizers.Optimizer]:
    """The Keras class of one of the optimizers foldsweep makes itself (``OPTIMIZERS``)."""
    return getattr(keras.optimizers, OPTIMIZERS[name][0])


@dataclass(frozen=True)
class OptimizerRecipe:
    """How to make a fold's optimizer: a Keras class and its configuration, gradient clipping
    included; ``source`` says whose it is: ``hypermodel`` (its own compile), ``spec`` (foldsweep's,
    named by the spec) or ``default``."""

    cls: type[keras.optimizers.Optimizer]
    config: Mapping[str, Any]
    source: str
    # The variables the compiled optimizer's exclude_from_weight_decay() leaves out, which its
    # config does not carry: their positions in the model's trainable variables (the same in every
    # fold's model and in the stacked ones, whose names a name pattern would not find alike).
    decay_excluded: tuple[int, ...] = ()
    # Whether the spec's clipping ``none`` cleared the compiled optimizer's own clipping.
    clipping_cleared: bool = False

    def make(self, variables: Sequence[Any], *, clipping: bool = True) -> keras.optimizers.Optimizer:
        """A fresh optimizer (every fold has its own state) for ``variables``, a model's trainable
        variables in their order (needed where variables are left out of weight decay); without
        its clipping when the gradients are clipped before it (stacked folds clip each fold's
        slices themselves). Without its ``loss_scale_factor``: fit scales the loss by it before
        the gradients and the optimizer divides them by it, which cancel in float32; foldsweep's
        step leaves out both (``TrialPlan.loss_scale_factor`` records it)."""
        config = {**self.config, "loss_scale_factor": None}
        if not clipping:
            config.update({argument: None for argument in CLIPPING_ARGUMENTS.values()})
        optimizer = remade_optimizer(self.cls, config)
        if self.decay_excluded:
            optimizer.exclude_from_weight_decay(var_list=[variables[position] for position in self.decay_excluded])
        return optimizer

    @property
    def loss_scale_factor(self) -> float | None:
        """The factor fit would scale the loss by and the optimizer divide the gradients by; None
        where there is none, or it is 1."""
        factor = self.config.get("loss_scale_factor")
        return None if factor is None or float(factor) == 1.0 else float(factor)

    @property
    def clipping(self) -> tuple[str, float | None]:
        """The clipping kind and threshold in the configuration (Keras allows one at a time)."""
        for kind, argument in CLIPPING_ARGUMENTS.items():
            if self.config.get(argument) is not None:
                return kind, self.config[argument]
        return NO_CLIPPING, None

    @property
    def name(self) -> str:
        """The spec's name of the optimizer where it has one (adam, sgd...), else its class."""
        return next((name for name in OPTIMIZERS if optimizer_class(name) is self.cls), self.cls.__name__)

    @property
    def learning_rate(self) -> float | str:
        """The learning rate in effect, as the optimizer holds it (float32: shown to 7 digits), or
        its schedule as a call (``ExponentialDecay(0.01, decay_steps=1000, decay_rate=0.9)``)."""
        rate = self.config.get("learning_rate")
        return float(f"{rate:.7g}") if isinstance(rate, (int, float)) else schedule_text(rate)


def optimizer_recipe(
    model: keras.Model | None, params: TrainingParams, *, spec_names: frozenset[str] = frozenset()
) -> OptimizerRecipe:
    """A fold model's optimizer: the one its build compiled, if any, else (or without a model)
    foldsweep's. The spec's ``optimizer``, ``learning_rate`` and ``clipping`` replace the compiled
    ones only where the spec's search space names them (``spec_names``): a named clipping is the
    optimizer's whole clipping (``none`` clears the compiled one's clipnorm, clipvalue and
    global_clipnorm), as the trial records it."""
    compiled = getattr(model, "optimizer", None)
    if compiled is not None and "optimizer" not in spec_names:
        config = optimizer_config(compiled, "the build")
        if "learning_rate" in spec_names:
            config["learning_rate"] = params.learning_rate
        assert model is not None  # the model that compiled the optimizer
        # Only where the optimizer decays weights at all: elsewhere leaving some out changes nothing.
        excluded = weight_decay_exclusions(compiled, model.trainable_variables) if config.get("weight_decay") else ()
        recipe = OptimizerRecipe(type(compiled), config, "hypermodel", excluded)
    else:
        if params.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {params.optimizer!r}")
        cls, fixed = optimizer_class(params.optimizer), OPTIMIZERS[params.optimizer][1]
        config = cls(learning_rate=params.learning_rate, **fixed).get_config()
        recipe = OptimizerRecipe(cls, config, "spec" if spec_names & {"optimizer", "learning_rate"} else "default")
    if params.clipping != NO_CLIPPING or "clipping" in spec_names:
        clip: dict[str, float | None] = {argument: None for argument in CLIPPING_ARGUMENTS.values()}
        if params.clipping != NO_CLIPPING:
            clip[CLIPPING_ARGUMENTS[params.clipping]] = params.clip_threshold
        cleared = params.clipping == NO_CLIPPING and recipe.clipping[0] != NO_CLIPPING
        recipe = replace(recipe, config={**recipe.config, **clip}, clipping_cleared=cleared)
    return recipe


class TrialConfig(NamedTuple):
    """A trial's config resolved once (``TrainingRecipe.resolve``)."""

    config: dict[str, Any]  # the values the trial uses (``resolve_config``)
    params: TrainingParams  # its training hyperparameters
    model_values: dict[str, Any]  # the values its build gets
    epochs: int


@dataclass(frozen=True)
class TrainingRecipe:
    """What a sweep's trials share in how they train: the spec's ``train`` section, the
    execution it (or a debugging command) asks for, and what the search space says of the
    training hyperparameters."""

    train: TrainSpec = TrainSpec()
    choices: ExecutionChoices = ExecutionChoices()
    conditions: Mapping[str, Any] = field(default_factory=dict)
    # Training hyperparameters the spec's search space names: they replace a compiled model's own.
    spec_names: frozenset[str] = frozenset()
    # foldsweep's training hyperparameter -> the hypermodel's that a fit() override feeds it from.
    fit_arguments: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_spec(
        cls,
        spec: SweepSpec,
        *,
        conditions: Mapping[str, Any] | None = None,
        fit_arguments: Mapping[str, str] | None = None,
        eager: bool = False,
        check_numerics: bool = False,
    ) -> TrainingRecipe:
        train = spec.train
        # XLA-compiled steps are opaque to TensorFlow's numeric checking, and eager runs op by op.
        jit_compile = "off" if check_numerics or eager else train.jit_compile
        choices = ExecutionChoices(
            jit_compile=jit_compile,
            fused=train.fused,
            steps_per_launch=train.steps_per_launch,
            inline_step=train.inline_step,
            pad_last_batch=train.pad_last_batch,
            graph_optimizer=train.graph_optimizer,
            eager=eager,
            check_numerics=check_numerics,
        )
        return cls(
            train=train,
            choices=choices,
            conditions=dict(conditions or {}),
            spec_names=frozenset(TRAINING_DEFAULTS).intersection(spec.search.space),
            fit_arguments=dict(fit_arguments or {}),
        )

    def resolve(self, config: Mapping[str, Any] | TrialConfig) -> TrialConfig:
        """A config as a trial trains it: the values it uses (``conditions``), its training
        hyperparameters (fit arguments of a HyperModel.fit taken from the hyperparameters that
        feed them), the values its build gets, ``train.epochs`` unless the config sets its own.
        A config already resolved is returned as it is."""
        if isinstance(config, TrialConfig):
            return config
        used = resolve_config(config, self.conditions)
        training, model_values = split_config(used)
        for name, source in self.fit_arguments.items():
            training[name] = used.get(source, training.get(name))
        epochs = training.pop("epochs") or self.train.epochs
        return TrialConfig(used, TrainingParams(**training), model_values, epochs)

    def optimizer(self, model: keras.Model, params: TrainingParams) -> OptimizerRecipe:
        return optimizer_recipe(model, params, spec_names=self.spec_names)

    def loss(
        self,
        model: keras.Model,
        *,
        units: int,
        regression: bool = False,
        per_position: bool = False,
        one_hot_labels: bool = False,
    ) -> TrainingLoss:
        return training_loss(
            model,
            train=self.train,
            units=units,
            regression=regression,
            per_position=per_position,
            one_hot_labels=one_hot_labels,
        )
