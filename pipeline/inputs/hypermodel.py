"""Experiments: load a researcher's KerasTuner hypermodel and build it for one trial.

The contract is KerasTuner's: ``build(hp) -> keras.Model`` as a plain function, or a
``keras_tuner.HyperModel`` (class or instance, optionally with a ``fit`` that tunes fit
arguments). foldsweep never asks the researcher to change it:

- the space is discovered by building with fresh ``HyperParameters``, again for every value of
  each choice and at the bounds of each number, until no build adds a name (a loop over
  ``num_layers`` asks for ``units_2`` only when it runs three times); a hyperparameter that only
  some values of another ask for gets that condition, so trials record only what their model
  asked for;
- a model with no declared input (a ``Sequential`` without ``Input``, a subclassed model) is
  built on the dataset's sample shape;
- a model the hypermodel compiled keeps its optimizer and loss (each fold gets its own copy of the
  optimizer, from ``pipeline.engine.recipe``); an uncompiled one gets foldsweep's;
- a ``HyperModel.fit`` that passes ``batch_size``/``epochs``/``shuffle`` to ``model.fit`` is read
  once with a recording model: those become foldsweep's, and an ``EarlyStopping`` callback its
  early stopping on the mean CV curve; one that does more is refused.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import keras
import keras_tuner
import numpy as np
from keras_tuner.src.engine import conditions as conditions_module
from keras_tuner.src.engine.hyperparameters import hp_types

from pipeline.base.errors import ExperimentError
from pipeline.base.keras_private import compiled_loss_weights, flatten_layers
from pipeline.inputs.scoring import OWN_SCORES, direction_of, is_per_position, is_regression
from pipeline.inputs.spec import CLIPPING_ARGUMENTS, EarlyStoppingSpec, TrainSpec

MAX_DISCOVERY_BUILDS = 64
# A number hyperparameter with at most this many values is enumerated to find which of its
# values ask for a name that its bounds revealed (the length of a loop, say).
MAX_ENUMERATED_VALUES = 32
# What foldsweep takes from a HyperModel.fit override's call to model.fit: its training
# hyperparameters. Everything else there would be something foldsweep cannot reproduce.
FIT_ARGUMENTS = ("batch_size", "epochs", "shuffle")
QUIET_FIT_ARGUMENTS = ("verbose",)


@dataclass(frozen=True)
class Experiment:
    """A loaded hypermodel: the hyperparameters its build (and fit) ask for, and what it declares."""

    reference: str
    build_fn: Callable[[keras_tuner.HyperParameters], Any]
    hyperparameters: keras_tuner.HyperParameters
    input_shape: tuple[int | None, ...] | None  # None: built on the data's shape
    compiled_optimizer: str | None = None  # the optimizer class its build compiles, if any
    compiled_schedule: str | None = None  # its learning-rate schedule, as a call, if it has one
    compiled_clipping: str | None = None  # its gradient clipping, as an argument (clipnorm=1), if it clips
    # foldsweep's training hyperparameter -> the hyperparameter a fit() override feeds it from.
    fit_arguments: Mapping[str, str] = field(default_factory=dict)
    # The EarlyStopping a fit() override passes, as a rule on the mean CV curve.
    fit_early_stopping: EarlyStoppingSpec | None = None
    fit_restores_best_weights: bool = False
    # The class_weight a fit() override passes ({label: weight}), as train.class_weight.
    fit_class_weight: Mapping[int, float] | None = None

    def build(self, values: Mapping[str, Any], input_shape: tuple[int, ...] | None = None) -> keras.Model:
        return build_model(self.build_fn, values, input_shape=input_shape, reference=self.reference)

    def output_units(self, input_shape: tuple[int, ...]) -> int:
        """The classes the default model predicts for samples of ``input_shape``.

        Raises:
            ExperimentError: the model cannot be built on (or run on) samples of that shape.
        """
        return self.head(np.zeros((1, *input_shape), np.float32), train=TrainSpec(from_logits=True)).units

    def head(
        self, samples: np.ndarray, *, train: TrainSpec, labels: np.ndarray | None = None, one_hot: bool = False
    ) -> ModelHead:
        """The default model built on the shape of ``samples`` (real ones, a small batch), its
        outputs on them and the loss it trains with (``train.from_logits`` for foldsweep's own;
        ``one_hot`` whether ``labels`` were one-hot rows, ``Dataset.one_hot``).

        Raises:
            ExperimentError: the model cannot be built on (or run on) such samples, its loss
                cannot train it as ``fit`` would, or its outputs are not what its loss reads
                them as (probabilities under a cross-entropy without ``from_logits``).
        """
        from pipeline.inputs.losses import LOSS_CLASSES, outputs_problem, traced_loss, training_loss

        input_shape = tuple(samples.shape[1:])
        try:
            model = self.build({}, input_shape)
            returned = keras.tree.flatten(model(samples.astype(np.float32), training=False))
            if len(returned) > 1:
                raise ExperimentError(_several_outputs(f"the model of {self.reference}", model, len(returned)))
            outputs = np.asarray(returned[0])
            units, parameters = int(outputs.shape[-1]), int(model.count_params())
            last_layer = _last_layer(model)
            one_for_any_input = units == 1 and _one_for_any_input(model, outputs, input_shape)
        except ExperimentError:
            raise
        except Exception as exc:
            declared = f" (it declares inputs of shape {self.input_shape})" if self.input_shape else ""
            from pipeline.inputs.datasets import channel_axis_hint

            raise ExperimentError(
                f"experiment: the model of {self.reference}{declared} cannot be built on the data's samples of shape "
                f"{input_shape}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                f"{channel_axis_hint(input_shape)}"
            ) from None
        finally:
            keras.backend.clear_session(free_memory=False)
        if one_for_any_input:
            raise ExperimentError(
                f"experiment: the model of {self.reference} ends in {last_layer}, whose one output is 1 for every "
                "sample (a softmax over one unit), so nothing it learns can change a prediction: a binary "
                "classifier ends in Dense(1, activation='sigmoid')"
            )
        regression = labels is not None and is_regression(labels)
        per_position = labels is not None and is_per_position(labels)
        try:
            loss = training_loss(
                model,
                train=train,
                units=units,
                regression=regression,
                per_position=per_position,
                one_hot_labels=one_hot,
            )
        except ExperimentError as exc:
            raise ExperimentError(f"experiment: {self.reference}: {exc}") from None
        traced = traced_loss(loss, outputs)
        if traced.problem:
            problem, fix = traced.problem
            raise ExperimentError(
                f"experiment: {self.reference}: its loss {loss.describe()} cannot be traced as Keras' fit traces its "
                f"training step (in a graph, without AutoGraph: Python control flow on a tensor or a tensor's value "
                f"is an error there): {problem}; {fix}"
            )
        if traced.per_batch(len(outputs)):
            raise ExperimentError(
                f"experiment: {self.reference}: its loss {loss.describe()} gives one value for a whole batch (shape "
                f"{traced.value_shape} for {len(outputs)} samples), not one per sample, and foldsweep weighs, masks "
                "and scores each sample's loss: reduce over each sample's own values, not the batch's (a function "
                "of yours: a mean over axis=-1, not over everything; keras.losses.Dice or Tversky: axis=(1,) for one "
                "value per sample, axis=(1, 2, 3) for each image of a segmentation map)"
            )
        wrong_outputs = outputs_problem(loss, outputs)
        if wrong_outputs:
            assert loss.kind is not None  # only a Keras cross-entropy reads its outputs as probabilities
            fix = (
                "set train.from_logits: true in the spec"
                if model.loss is None
                else f"compile the loss with from_logits=True (keras.losses.{LOSS_CLASSES[loss.kind].__name__}"
                "(from_logits=True))"
            )
            activation = "sigmoid" if units == 1 else "softmax"
            raise ExperimentError(
                f"experiment: the model of {self.reference} ends in {last_layer}: on the data's first {len(samples)} "
                f"samples {wrong_outputs}, but its loss {loss.describe()} reads them as probabilities. If they are "
                f"logits, {fix}; else end the model in activation='{activation}'"
            )
        return ModelHead(
            units=units,
            parameters=parameters,
            loss=loss,
            output_shape=tuple(outputs.shape[1:]),
            scorers=self._scorers(model, outputs, train, labels, loss=loss),
        )

    def _scorers(
        self,
        model: keras.Model,
        outputs: np.ndarray,
        train: TrainSpec,
        labels: np.ndarray | None,
        *,
        loss: Any,
    ) -> tuple[Any, ...]:
        """The metrics the model compiles and ``train.metrics`` names, as Keras builds them on
        labels and outputs of the model's shapes."""
        from pipeline.inputs.scoring import ValidationMetrics

        try:
            metrics = ValidationMetrics(model, train.metrics, own_accuracy=loss.own_accuracy)
            targets = labels[: len(outputs)] if labels is not None else np.zeros(outputs.shape[:-1], np.int32)
            metrics.build(np.asarray(loss.metric_targets(targets, outputs)), outputs)
            return metrics.scorers()
        except Exception as exc:
            named = f" and train.metrics {list(train.metrics)}" if train.metrics else ""
            raise ExperimentError(
                f"experiment: the metrics of {self.reference}'s compile{named} cannot be built as Keras builds them "
                f"on its outputs of shape {outputs.shape[1:]}: {type(exc).__name__}: {_first_line(exc)}"
            ) from None


@dataclass(frozen=True)
class ModelHead:
    """What the default model predicts: its output units, its size and the loss it trains with."""

    units: int
    parameters: int
    loss: Any  # pipeline.inputs.losses.TrainingLoss
    scorers: tuple[Any, ...] = ()  # pipeline.inputs.scoring.Scorer of each compiled and train.metrics metric
    output_shape: tuple[int, ...] = ()  # of one sample


def output_units(model: keras.Model, input_shape: tuple[int, ...]) -> int:
    """The number of outputs of a model built (``build_model``) on samples of ``input_shape``."""
    if _declared_inputs(model):
        return int(model.outputs[0].shape[-1])
    return int(model(np.zeros((1, *input_shape), np.float32), training=False).shape[-1])


def _ones(outputs: np.ndarray) -> bool:
    # A softmax over one unit is exp(0)/exp(0), though some CPUs' kernels round it to 0.99999994.
    return bool(outputs.size) and np.allclose(outputs, 1.0, rtol=0.0, atol=1e-6)


def _one_for_any_input(model: keras.Model, outputs: np.ndarray, input_shape: tuple[int, ...]) -> bool:
    """Whether a one-unit model's output is 1 whatever it is fed, as a softmax over one unit's is:
    on the data's samples (``outputs``) and on zeros. A sigmoid head may saturate to 1 in float32
    on samples far from zero (raw pixel values, say) before any training, where zeros, through
    the fresh model's zero biases, give it about 0.5."""
    if not _ones(outputs):
        return False
    try:
        with warnings.catch_warnings():  # Keras' own warning of a softmax over one unit, said once already
            warnings.simplefilter("ignore", UserWarning)
            return _ones(np.asarray(model(np.zeros((1, *input_shape), np.float32), training=False)))
    except Exception:  # a model that cannot run on zeros (an Embedding's indices, say): its samples tell
        return True


def _several_outputs(whose: str, model: keras.Model, count: int) -> str:
    """Why a model with several outputs is refused: Keras' fit wants a label per output (or a
    loss per output), and foldsweep trains and scores one output against the data's y."""
    names = getattr(model, "output_names", None) or []
    named = f" ({', '.join(map(repr, names))})" if len(names) == count else ""
    return (
        f"experiment: {whose} has {count} outputs{named}; foldsweep trains and scores one output against the "
        "data's y: return one output"
    )


def _last_layer(model: keras.Model) -> str:
    layers = model.layers if _declared_inputs(model) else []
    if not layers:
        return f"the outputs of {type(model).__name__}.call"
    layer = layers[-1]
    activation = getattr(layer, "activation", None)
    named = getattr(activation, "__name__", None)
    return f"layer {layer.name!r} ({type(layer).__name__}" + (f", activation {named})" if named else ")")


def build_model(
    build_fn: Callable[[keras_tuner.HyperParameters], Any],
    values: Mapping[str, Any],
    *,
    input_shape: tuple[int, ...] | None = None,
    reference: str | None = None,
) -> keras.Model:
    """Build with the given hyperparameter values (names they leave unset take defaults); a
    model with no declared input is built on samples of ``input_shape``. ``reference`` names
    the experiment in a refusal (a worker's build has none: its trial fails with the reason)."""
    hp = keras_tuner.HyperParameters()
    hp.values = dict(values)
    try:
        model = build_fn(hp)
    except ExperimentError:
        raise
    except Exception as exc:
        raise ExperimentError(
            f"experiment: build(hp) raised {type(exc).__name__} when built with hyperparameters {dict(hp.values)}"
            f"{_where_raised(exc)}: {_message(exc)}"
        ) from None
    _refuse_reduced_precision(model, "build(hp)")
    declared = _declared_outputs(model)
    if declared > 1:
        whose = f"the model of {reference}" if reference else f"the model build(hp) returns for {dict(hp.values)}"
        raise ExperimentError(_several_outputs(whose, model, declared))
    if input_shape is not None and not _declared_inputs(model):
        _build_on(model, input_shape)
    return model


def _build_on(model: keras.Model, input_shape: tuple[int, ...]) -> None:
    """Build a model with no declared input on samples of ``input_shape``, with any batch size:
    a Sequential gets its layer graph, as ``Input`` would have given it; a subclassed model is
    called once on zeros, as Keras' first ``fit`` would."""
    if isinstance(model, keras.Sequential):
        model.build((None, *input_shape))
    else:
        model(np.zeros((1, *input_shape), np.float32))


def _declared_outputs(model: keras.Model) -> int:
    """How many outputs a model declares (a functional model, a Sequential with an Input); 0
    where only a call tells (a Sequential without Input, a subclassed model)."""
    try:
        return len(model.outputs)
    except (AttributeError, ValueError, TypeError):
        return 0


def _declared_inputs(model: keras.Model) -> bool:
    try:
        return bool(model.inputs)
    except (AttributeError, ValueError):  # a Sequential without Input, a subclassed model
        return False


def load_experiment(path: Path, attr: str, *, reference: str | None = None) -> Experiment:
    """Import the experiment file, find its hypermodel and discover its space.

    Raises:
        ExperimentError: missing file, import failure, no such builder, build raising or
            returning something that is not a Keras model, a compile foldsweep cannot honour,
            or a fit() override that does what foldsweep cannot reproduce.
    """
    reference = reference or f"{path}:{attr}"
    hypermodel = load_hypermodel(path, attr, reference=reference)
    build_fn = hypermodel.build
    hp = keras_tuner.HyperParameters()
    model = _checked_build(build_fn, hp, reference, "default hyperparameters")
    _refuse_reduced_precision(model, reference)
    input_shape = tuple(model.inputs[0].shape[1:]) if _declared_inputs(model) else None
    _refuse_own_training(model, reference)
    compiled, schedule = _compiled_optimizer(model, reference)
    clipping = _compiled_clipping(model)
    fit_arguments, (early_stopping, restores_best), class_weight = _read_fit(hypermodel, model, hp, reference)
    if not _discover(build_fn, hp, reference, first=model):  # no build to tell shared layers by: one more
        again = _checked_build(build_fn, keras_tuner.HyperParameters(), reference, "them again")
        _refuse_shared_layers(model, again, reference)
    # Keras' names start afresh for the trials; no garbage collection, which takes seconds in a
    # large process for models this small.
    keras.backend.clear_session(free_memory=False)
    return Experiment(
        reference,
        build_fn,
        hp,
        input_shape,
        compiled,
        schedule,
        clipping,
        fit_arguments,
        early_stopping,
        restores_best,
        class_weight,
    )


# The methods through which Keras 3 lets a model train or score itself its own way, with what to
# do instead: foldsweep's compiled step calls the model and its compiled loss directly, so an
# override would be bypassed and the sweep would rank something else than the model's fit trains.
TRAINING_OVERRIDES: Mapping[str, str] = {
    "train_step": "put the loss in compile(loss=...) and extra loss terms in a layer's self.add_loss(...); a step "
    "of its own (several optimizers, gradient penalties) can only be trained by model.fit",
    "test_step": "validation scores come from the compiled loss and accuracy: put the loss in compile(loss=...)",
    "compute_loss": "put the loss in compile(loss=...) and extra loss terms in a layer's self.add_loss(...)",
    "compute_metrics": "foldsweep records the loss and accuracy itself: drop the override",
}


# Why fold models must not share what they train: what a refusal of those that do says.
SHARED_LAYERS_RULE = (
    "each fold trains a model of its own from its fresh weights, and a layer two folds train carries one fold's "
    "training into the other's, its validation samples included, so the scores would not be cross-validation. "
    "Make the model and its layers inside build(hp), afresh at each call (a frozen base, trainable=False, may be "
    "shared)"
)


def _refuse_shared_layers(first: keras.Model, second: keras.Model, reference: str) -> None:
    """Two builds with the same values make models of their own to train: not the same model, and
    no trainable layer of one in the other (a model kept from an earlier call, layers made once
    outside build). A frozen layer, which no fold trains, may be shared."""
    if second is first:
        raise ExperimentError(
            f"experiment: {reference} returns the same model object at every call: {SHARED_LAYERS_RULE}"
        )
    shared = {id(layer) for layer in first.layers if layer.trainable} & {id(layer) for layer in second.layers}
    if shared:
        names = [layer.name for layer in first.layers if id(layer) in shared]
        raise ExperimentError(
            f"experiment: {reference} returns models that share the trainable layers {names} between calls: "
            f"{SHARED_LAYERS_RULE}"
        )


def _refuse_own_training(model: keras.Model, reference: str) -> None:
    for method, instead in TRAINING_OVERRIDES.items():
        owner = next(cls for cls in type(model).__mro__ if method in vars(cls))
        if not owner.__module__.startswith("keras."):
            raise ExperimentError(
                f"experiment: {reference}: {owner.__name__} overrides {method}, which foldsweep's training would "
                f"bypass (it trains the folds with its own compiled step, not model.fit): {instead}"
            )


# The compute dtypes of Keras' mixed precision policies (mixed_float16, mixed_bfloat16) and of
# its float16 and bfloat16 ones. Keras' fit trains float16 with a scaled loss (the optimizer a
# mixed_float16 model compiles is a LossScaleOptimizer) and skips the steps whose gradients
# overflow; foldsweep's step trains every fold in float32 terms and feeds no scaled loss, so the
# gradients would come out divided by the loss scale (2^15 at first) and the model would stay at
# chance where fit trains it as it trains float32. bfloat16 needs no loss scale, but foldsweep's
# step was never checked against fit in it: refused all the same rather than trained unchecked.
REDUCED_PRECISION_DTYPES = ("float16", "bfloat16")
MIXED_PRECISION_FIX = (
    "foldsweep trains every model in float32: its step does not scale the loss as Keras' fit does "
    "under mixed_float16, nor is it checked against fit in float16 or bfloat16, so the sweep would "
    "rank models trained otherwise than fit trains them: drop {what} (the trials then train in "
    "float32)"
)


def _refuse_reduced_precision(model: keras.Model, reference: str) -> None:
    """Refuse a model that computes in float16 or bfloat16 (a global or a layer's dtype policy)
    or compiles Keras' loss scaling, with what sets it; the global policy a build set is reset
    first, so that it reaches no later build in this process (a worker's next trial)."""
    from keras.optimizers import LossScaleOptimizer

    policy = keras.config.dtype_policy()
    if policy.compute_dtype in REDUCED_PRECISION_DTYPES:
        keras.config.set_dtype_policy("float32")
        raise ExperimentError(
            f"experiment: {reference} sets the global dtype policy {policy.name!r}: "
            + MIXED_PRECISION_FIX.format(
                what="the call to keras.mixed_precision.set_global_policy (or keras.config.set_dtype_policy)"
            )
        )
    layers = flatten_layers(model)
    reduced = next((layer for layer in layers if layer.dtype_policy.compute_dtype in REDUCED_PRECISION_DTYPES), None)
    if reduced is not None:
        raise ExperimentError(
            f"experiment: {reference}: layer {reduced.name!r} ({type(reduced).__name__}) computes under the dtype "
            f"policy {reduced.dtype_policy.name!r}: "
            + MIXED_PRECISION_FIX.format(what=f"dtype={reduced.dtype_policy.name!r}")
        )
    if isinstance(getattr(model, "optimizer", None), LossScaleOptimizer):
        raise ExperimentError(
            f"experiment: {reference} compiles a LossScaleOptimizer: "
            + MIXED_PRECISION_FIX.format(what="the LossScaleOptimizer, compile the optimizer it wraps")
        )


def optimizer_config(optimizer: Any, reference: str) -> dict[str, Any]:
    """The configuration each fold's copy of a compiled optimizer is made from (``remade_optimizer``).

    Raises:
        ExperimentError: Keras cannot write it (a learning-rate schedule without get_config).
    """
    try:
        return dict(optimizer.get_config())
    except NotImplementedError as exc:  # keras.io's examples write schedules without get_config
        raise ExperimentError(
            f"experiment: {reference} compiles a {type(optimizer).__name__} optimizer whose configuration Keras "
            f"cannot write ({_message(exc)}); foldsweep makes each fold's optimizer from it, as Keras "
            "saves the model with it: give the schedule a get_config() that returns its __init__ arguments"
        ) from exc


def remade_optimizer(cls: type[keras.optimizers.Optimizer], config: Mapping[str, Any]) -> Any:
    """A new optimizer of ``cls`` from a compiled one's ``config`` (``optimizer_config``), as each
    fold's is made: Keras finds only its own classes and those registered with
    ``keras.saving.register_keras_serializable``, so the researcher's own learning-rate schedule
    class is looked up where Keras wrote it was defined (the experiment file, or a module it
    imports)."""
    rate = config.get("learning_rate")
    own: dict[str, Any] = {}
    if isinstance(rate, dict) and isinstance(rate.get("class_name"), str):
        module = str(rate.get("module"))
        schedule = getattr(_EXPERIMENT_MODULES.get(module) or sys.modules.get(module), rate["class_name"], None)
        own = {rate["class_name"]: schedule} if isinstance(schedule, type) else {}
    return cls.from_config(dict(config), custom_objects=own)


def _compiled_clipping(model: keras.Model) -> str | None:
    """The gradient clipping of the optimizer a build compiled, as its argument (``clipnorm=1``)."""
    optimizer = getattr(model, "optimizer", None)
    config = optimizer.get_config() if optimizer is not None else {}
    clips = [f"{argument}={config[argument]:g}" for argument in CLIPPING_ARGUMENTS.values() if config.get(argument)]
    return clips[0] if clips else None


def _compiled_optimizer(model: keras.Model, reference: str) -> tuple[str | None, str | None]:
    """The optimizer class a build compiled and its learning-rate schedule, if any."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None, None
    loss = getattr(model, "loss", None)
    if isinstance(loss, (dict, list, tuple)):
        per_output = ", ".join(map(repr, loss)) if isinstance(loss, dict) else f"{len(loss)} losses"
        raise ExperimentError(
            f"experiment: {reference} compiles one loss per output ({per_output}); foldsweep trains and "
            "scores one output against the data's y: return one output and compile one loss"
        )
    weights = compiled_loss_weights(model)
    if weights is not None:
        raise ExperimentError(
            f"experiment: {reference} compiles loss_weights={weights!r}; foldsweep trains the loss "
            "unweighted: drop loss_weights (with one output it only scales the learning rate)"
        )
    config = optimizer_config(optimizer, reference)
    if config.get("use_ema"):
        raise ExperimentError(
            f"experiment: {reference} compiles a {type(optimizer).__name__} optimizer with use_ema=True; "
            "model.fit ends by replacing the weights with their moving average, which foldsweep's "
            "folds and refit do not: drop use_ema"
        )
    try:
        remade_optimizer(type(optimizer), config)
    except Exception as exc:  # what each fold's copy is made by; Keras may fail it in any way
        raise ExperimentError(
            f"experiment: {reference} compiles a {type(optimizer).__name__} optimizer that Keras cannot make "
            f"again from its configuration ({type(exc).__name__}: {_message(exc)}); foldsweep makes each fold's "
            "optimizer so, as Keras loads a saved model: a class of yours in it (a schedule, an optimizer subclass) "
            "needs a get_config() that returns every argument of its __init__, and where Keras cannot find it (a "
            "class defined inside build), @keras.saving.register_keras_serializable()"
        ) from exc
    if not optimizer.built and _trains_otherwise_built_in_the_step(type(optimizer), config):
        raise ExperimentError(
            f"experiment: {reference} compiles a {type(optimizer).__name__} optimizer, unbuilt, that trains otherwise "
            "when built inside the training step: Keras' fit on TensorFlow builds it there, where what its build "
            "sets from the weights (ScheduleFreeAdamW's momentum) is set again at every step, which its algorithm "
            "does not do; foldsweep builds each fold's before training, so its folds would not train as fit does. "
            "Build it in build(hp) after compile, model.optimizer.build(model.trainable_variables) on a built model "
            "(keras.Input), and fit trains it as foldsweep does"
        )
    rate = config.get("learning_rate")
    schedule = None if isinstance(rate, (int, float)) else schedule_text(rate)
    return type(optimizer).__name__, schedule


def _trains_otherwise_built_in_the_step(cls: type[keras.optimizers.Optimizer], config: Mapping[str, Any]) -> bool:
    """Whether an optimizer of ``cls`` built inside a traced step, as Keras' fit on TensorFlow
    builds one a model compiled, ends two steps in another state than one built before them (what
    foldsweep does for each fold): ScheduleFreeAdamW's build starts its momentum at the weights,
    and built inside the step it starts it again at every step. Two steps on a 2x2 weight, which
    is changed between them."""
    import tensorflow as tf

    def state_two_steps_on(built_first: bool) -> list[np.ndarray]:
        probe = remade_optimizer(cls, config)
        weight = keras.Variable(np.ones((2, 2), np.float32))
        if built_first:
            probe.build([weight])
        step = tf.function(lambda: probe.apply([tf.fill((2, 2), 0.1)], [weight]), autograph=False)
        step()
        weight.assign(np.full((2, 2), 3.0, np.float32))
        step()
        return [np.array(variable.numpy()) for variable in probe.variables]

    try:
        in_the_step, before = state_two_steps_on(False), state_two_steps_on(True)
    except Exception:  # a class of the researcher's that cannot step a 2x2 weight: not known to differ
        return False
    return any(not np.array_equal(a, b, equal_nan=True) for a, b in zip(in_the_step, before))


def _discover(
    build_fn: Callable[[Any], Any], space: keras_tuner.HyperParameters, reference: str, *, first: keras.Model
) -> int:
    """Grow ``space`` with the hyperparameters that builds with other values ask for; returns how
    many builds it made, each checked to share no trainable layer with ``first`` (the default
    build, ``_refuse_shared_layers``).

    A build with defaults registers only the hyperparameters on the default path; those in a
    conditional scope of another value of a choice, or in a loop whose length is a number, appear
    only when that value is taken. Each choice value and each number's bounds are built once,
    until no build adds a name. A name revealed by some value of another hyperparameter gets
    that condition (its values that ask for it, enumerated where there are few). A branch that
    fails to build is skipped here: it fails its own trials, which the sweep records, as
    KerasTuner would.
    """
    tried: set[tuple[str, Any]] = set()
    builds = 0
    while builds < MAX_DISCOVERY_BUILDS:
        untried = [
            (hp, value)
            for hp in space.space
            for value in _probe_values(hp, bounds_only=True)
            if (hp.name, value) not in tried
        ]
        if not untried:
            break
        hp, value = untried[0]
        tried.add((hp.name, value))
        builds += 1
        asked = _asked_for(build_fn, _activating(hp, value), reference, first=first)
        known = {other.name for other in space.space}
        new = [found for name, found in asked.items() if name not in known]
        unconditioned = [found.name for found in new if not found.conditions]
        activity = (
            _values_asking(build_fn, hp, unconditioned, reference, builds_left=MAX_DISCOVERY_BUILDS - builds)
            if unconditioned
            else {}
        )
        builds += len(activity)
        for found in new:
            active = [v for v, names in activity.items() if found.name in names]
            if not found.conditions and active and len(active) < len(activity):
                found.conditions = [conditions_module.Parent(hp.name, active)]
            space.merge([found])
    return builds


def _probe_values(hp: Any, *, bounds_only: bool) -> list[Any]:
    """The values of ``hp`` a discovery builds with: every choice; a number's bounds, or all its
    values when it has few and ``bounds_only`` is off."""
    if isinstance(hp, hp_types.Boolean):
        return [True, False]
    if isinstance(hp, hp_types.Choice):
        return list(hp.values)
    if not isinstance(hp, (hp_types.Int, hp_types.Float)):
        return []
    enumerable = isinstance(hp, hp_types.Int) or hp.step is not None
    if not bounds_only and enumerable:
        values = list(hp.values)
        if len(values) <= MAX_ENUMERATED_VALUES:
            return values
    return [hp.min_value, hp.max_value]


def _activating(hp: Any, value: Any) -> dict[str, Any]:
    """Values that build ``hp`` at ``value``: its own, and those its conditions need."""
    values = {
        condition.name: condition.values[0]
        for condition in hp.conditions
        if isinstance(condition, conditions_module.Parent)
    }
    return {**values, hp.name: value}


def _asked_for(
    build_fn: Callable[[Any], Any], values: Mapping[str, Any], reference: str, *, first: keras.Model | None = None
) -> dict[str, Any]:
    """The hyperparameters one build with ``values`` asks for (empty if the build fails).

    Raises:
        ExperimentError: the build trains in reduced precision (refused for the whole sweep), or
            shares a trainable layer with ``first``.
    """
    branch = keras_tuner.HyperParameters()
    branch.values = dict(values)
    try:
        model = build_fn(branch)
    except Exception:
        return {}
    if isinstance(model, keras.Model):
        _refuse_reduced_precision(model, f"{reference} built with {dict(values)}")
        if first is not None:
            _refuse_shared_layers(first, model, reference)
    return {hp.name: hp for hp in branch.space}


def _values_asking(
    build_fn: Callable[[Any], Any], hp: Any, names: list[str], reference: str, *, builds_left: int
) -> dict[Any, set[str]]:
    """For each value of ``hp`` (enumerated), which of ``names`` a build with it asks for; empty
    when ``hp`` has too many values to enumerate."""
    values = _probe_values(hp, bounds_only=False)
    if len(values) > min(builds_left, MAX_ENUMERATED_VALUES):
        return {}
    return {value: set(_asked_for(build_fn, _activating(hp, value), reference)) & set(names) for value in values}


class _RecordingFit:
    """Stands in for ``model.fit`` while a HyperModel's fit override is read: records the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return keras.callbacks.History()

    def __repr__(self) -> str:
        # Python names the callable in a TypeError of its call: the researcher called model.fit.
        return "model.fit()"


def _read_fit(
    hypermodel: Any, model: keras.Model, hp: keras_tuner.HyperParameters, reference: str
) -> tuple[dict[str, str], tuple[EarlyStoppingSpec | None, bool], dict[int, float] | None]:
    """What a HyperModel's ``fit`` override asks of training, read with a recording model.

    The override is called as KerasTuner's tuner calls it (``x``, ``y``, ``validation_data``,
    ``callbacks``); the hyperparameters it registers join ``hp``. It must pass them on to one
    ``model.fit`` call unchanged, adding only ``batch_size``, ``epochs``, ``shuffle`` (and
    ``verbose``) and an ``EarlyStopping`` callback. Returns foldsweep's training names -> the
    hyperparameters that feed them, and the early stopping it asks for (with whether it
    restores the best weights).

    Raises:
        ExperimentError: the override fails, trains on its own, changes the data, or adds arguments
            or callbacks that foldsweep cannot reproduce (every one of those in one message).
    """
    if not isinstance(hypermodel, keras_tuner.HyperModel) or type(hypermodel).fit is keras_tuner.HyperModel.fit:
        return {}, (None, False), None
    where = f"experiment: {reference}: its HyperModel.fit"
    recording = _RecordingFit()
    x, y = np.zeros((2, 1), np.float32), np.zeros((2,), np.int32)
    validation = (np.zeros((2, 1), np.float32), np.zeros((2,), np.int32))
    callbacks: list[Any] = []  # as KerasTuner passes its own: the fit's may add to this very list
    own_callbacks = list(callbacks)
    model.fit = recording
    try:
        hypermodel.fit(hp, model, x, y, validation_data=validation, callbacks=callbacks)
    except Exception as exc:
        text = str(exc)
        twice = "got multiple values for keyword argument 'callbacks'" in text
        hint = (
            " (KerasTuner passes callbacks in **kwargs too: add yours to them, kwargs['callbacks'] = "
            "kwargs.get('callbacks', []) + [...])"
            if twice
            else ""
        )
        raise ExperimentError(
            f"{where} failed when called as KerasTuner calls it (x, y, validation_data=..., callbacks=[...]): "
            f"{type(exc).__name__}: {text}{hint}. foldsweep trains the model itself: keep fit() to "
            f"`return model.fit(*args, batch_size=hp..., epochs=hp..., **kwargs)`"
        ) from None
    finally:
        del model.fit
    if len(recording.calls) != 1:
        raise ExperimentError(
            f"{where} calls model.fit {len(recording.calls)} times; foldsweep trains the model itself and can "
            "only take the fit arguments of one model.fit(*args, **kwargs) call: move a training loop of your own "
            "out of the hypermodel"
        )
    args, kwargs = recording.calls[0]
    given = {
        "x": args[0] if args else kwargs.pop("x", None),
        "y": args[1] if len(args) > 1 else kwargs.pop("y", None),
        "validation_data": kwargs.pop("validation_data", None),
    }
    expected = {"x": x, "y": y, "validation_data": validation}
    changed = [name for name in expected if given[name] is not expected[name]]
    problems = []
    if changed or len(args) > 2:
        problems.append(
            f"other {', '.join(changed) or 'positional arguments'} than it was given (preprocessing or "
            "data of its own): foldsweep feeds the folds itself, move preprocessing into build(hp) as "
            "layers or into the dataset"
        )
    passed = kwargs.pop("callbacks", None) or []
    added = [callback for callback in passed if not any(callback is own for own in own_callbacks)]
    early_stopping, refused_callbacks = _early_stopping_of(added)
    problems += refused_callbacks
    class_weight, weight_problem = _fit_class_weight(
        kwargs.pop("class_weight", None), hypermodel, model, hp, x, validation
    )
    problems += [weight_problem] if weight_problem else []
    problems += [
        f"{name}=...: {FIT_ARGUMENT_ADVICE.get(name, 'foldsweep cannot reproduce it: move it into build(hp) or the spec')}"
        for name in sorted(set(kwargs) - set(FIT_ARGUMENTS) - set(QUIET_FIT_ARGUMENTS))
    ]
    if problems:
        listed = "; ".join(f"({number}) {problem}" for number, problem in enumerate(problems, start=1))
        raise ExperimentError(
            f"{where} passes model.fit {len(problems)} thing{'s' if len(problems) > 1 else ''} foldsweep cannot "
            f"honour: {listed}. foldsweep trains the folds itself and runs no Keras callbacks: it takes "
            f"{', '.join(FIT_ARGUMENTS)} from fit(), and translates EarlyStopping on val_loss or val_accuracy"
        )
    return _fit_sources(kwargs, hp, where), early_stopping, class_weight


def _fit_class_weight(
    class_weight: Any,
    hypermodel: Any,
    model: keras.Model,
    hp: keras_tuner.HyperParameters,
    x: np.ndarray,
    validation: Any,
) -> tuple[dict[int, float] | None, str | None]:
    """The class weights a fit() override passes, as constant {label: weight}; a problem when they
    are not such a mapping, or change with the labels the override is given (computed from them:
    foldsweep computes balanced weights from each training fold itself)."""
    if class_weight is None:
        return None, None
    advice = "use train.class_weight: balanced (computed from each training fold's labels) or {label: weight}"
    try:
        weights = {int(label): float(weight) for label, weight in dict(class_weight).items()}
    except (TypeError, ValueError):
        return None, f"class_weight={class_weight!r}: not a mapping of class labels to weights: {advice}"
    if any(not np.isfinite(weight) or weight <= 0 for weight in weights.values()):
        return None, f"class_weight={class_weight!r}: weights must be finite and > 0"
    again = _RecordingFit()
    model.fit = again
    try:
        hypermodel.fit(hp, model, x, np.ones((len(x),), np.int32), validation_data=validation, callbacks=[])
    except Exception:
        pass
    finally:
        del model.fit
    other = again.calls[0][1].get("class_weight") if len(again.calls) == 1 else None
    if other is None or {int(k): float(v) for k, v in dict(other).items()} != weights:
        return None, f"class_weight=... computed from the labels fit() is given, which are not a fold's: {advice}"
    return weights, None


# The callbacks foldsweep runs none of: why each common one cannot be honoured, and what does
# its job instead.
REFUSED_CALLBACKS: Mapping[str, str] = {
    "ModelCheckpoint": "foldsweep keeps its own per-epoch checkpoints and the refit's model (refit_model.keras)",
    "ReduceLROnPlateau": "it would change the learning rate mid-trial on the validation curve: compile a "
    "learning-rate schedule (keras.optimizers.schedules) instead",
    "TensorBoard": "every epoch of every fold is recorded in MLflow",
    "TerminateOnNaN": "foldsweep checks every step itself: a fold whose loss or gradient is not finite stops at that "
    "step, recorded with its epoch and step, and the other folds train on",
    "CSVLogger": "every epoch of every fold is recorded in MLflow (history.csv)",
}
# model.fit arguments a fit() override may pass that foldsweep does not take, and what to do.
FIT_ARGUMENT_ADVICE: Mapping[str, str] = {
    "validation_split": "each fold's held-out part is its validation data (cv in the spec): drop it",
    "sample_weight": "foldsweep trains the loss unweighted: drop it",
    "initial_epoch": "a trial trains from its first epoch (a resumed sweep goes on from its checkpoints): drop it",
    "steps_per_epoch": "a trial's epoch is one pass over each training fold: drop it",
    "validation_steps": "each epoch validates on the whole validation fold: drop it",
    "validation_freq": "each epoch validates on the whole validation fold: drop it",
    "validation_batch_size": "foldsweep validates in batches of its own (the scores do not depend on them): drop it",
}


def _early_stopping_of(callbacks: list[Any]) -> tuple[tuple[EarlyStoppingSpec | None, bool], list[str]]:
    """The rule a fit() override's ``EarlyStopping`` means on the mean CV curve, and whether it
    restores the best weights (None when it passes none); and what of ``callbacks`` foldsweep
    cannot honour: callbacks other than EarlyStopping, or one that watches something other than
    the validation loss or accuracy, each as a phrase."""
    rules, problems = [], []
    for callback in callbacks:
        name = type(callback).__name__
        if not isinstance(callback, keras.callbacks.EarlyStopping):
            why = REFUSED_CALLBACKS.get(name, "foldsweep trains the folds itself and runs no Keras callbacks")
            problems.append(f"the callback {name}, which foldsweep cannot honour: {why}")
            continue
        monitor = callback.monitor.removeprefix("val_")
        if not callback.monitor.startswith("val_"):
            problems.append(
                f"EarlyStopping(monitor={callback.monitor!r}): foldsweep stops a trial on its mean CV "
                "validation curve: monitor='val_loss', 'val_accuracy' or 'val_<metric>' (the training "
                "loss says nothing of overfitting)"
            )
            continue
        natural = OWN_SCORES.get(monitor) or direction_of(monitor)
        if natural is None and callback.mode == "auto":
            problems.append(
                f"EarlyStopping(monitor={callback.monitor!r}, mode='auto'): neither Keras nor KerasTuner "
                f"knows which way {monitor} improves: mode='max' or 'min'"
            )
            continue
        if natural is not None and callback.mode not in ("auto", natural):
            problems.append(
                f"EarlyStopping(monitor={callback.monitor!r}, mode={callback.mode!r}): {callback.monitor} "
                f"improves when it goes {'down' if natural == 'min' else 'up'}: mode='{natural}' or 'auto'"
            )
            continue
        # Keras counts an epoch before it compares: patience 0 stops where 1 does.
        rules.append(
            (
                EarlyStoppingSpec(
                    patience=max(int(callback.patience), 1),
                    monitor=monitor,
                    min_delta=abs(float(callback.min_delta)),
                    start_from_epoch=int(callback.start_from_epoch),
                    baseline=None if callback.baseline is None else float(callback.baseline),
                    mode=None if monitor in OWN_SCORES else natural or callback.mode,
                ),
                bool(callback.restore_best_weights),
            )
        )
    if len(rules) > 1:
        problems.append(f"{len(rules)} EarlyStopping callbacks: a trial stops by one rule, keep one")
    return (rules[0] if len(rules) == 1 else (None, False)), problems


def _fit_sources(kwargs: Mapping[str, Any], hp: keras_tuner.HyperParameters, where: str) -> dict[str, str]:
    """For each fit argument, the hyperparameter it came from (a constant becomes a fixed one)."""
    sources = {}
    for name in FIT_ARGUMENTS:
        if name not in kwargs:
            continue
        value = kwargs[name]
        matching = [candidate.name for candidate in hp.space if hp.values.get(candidate.name) == value]
        if not matching:  # a constant: a fixed hyperparameter of that name
            hp.Fixed(name, value)
            matching = [name]
        elif name in matching:
            matching = [name]
        elif len(matching) > 1:
            raise ExperimentError(
                f"{where} passes {name}={value!r}, the value of several hyperparameters "
                f"({', '.join(matching)}): name the one it comes from {name!r}"
            )
        sources[name] = matching[0]
    return sources


def _checked_build(
    build_fn: Callable[[Any], Any], hp: keras_tuner.HyperParameters, reference: str, with_what: str
) -> keras.Model:
    try:
        model = build_fn(hp)
    except Exception as exc:
        raise ExperimentError(
            f"experiment: {reference} raised {type(exc).__name__} when built with {with_what}{_where_raised(exc)}: "
            f"{_message(exc)}"
        ) from None
    if not isinstance(model, keras.Model):
        raise ExperimentError(f"experiment: {reference} must return a keras.Model, got {type(model).__name__}")
    return model


def load_builder(path: Path, attr: str, *, reference: str | None = None) -> Callable[[Any], Any]:
    """Import the experiment file and return its build(hp) callable (no build, no discovery)."""
    return load_hypermodel(path, attr, reference=reference).build


class _BuildFunction:
    """A plain build(hp) function with a HyperModel's face (``build``), and no fit override."""

    def __init__(self, build: Callable[[Any], Any]):
        self.build = build


# The experiment modules this process imported, by name (the latest of each), where their classes
# are found by the name Keras writes for them. Not in sys.modules: there, pickling would send the
# experiment's functions to Ray's workers by a module name they cannot import.
_EXPERIMENT_MODULES: dict[str, Any] = {}


def experiment_module_name(path: Path) -> str:
    """The name an experiment file is imported under (its classes' ``__module__``, which a saved
    model names them by)."""
    return f"foldsweep_experiment_{path.stem}"


def load_hypermodel(path: Path, attr: str, *, reference: str | None = None) -> Any:
    """Import the experiment file: its ``keras_tuner.HyperModel`` (instantiated), or its plain
    build(hp) function behind the same ``build`` face."""
    reference = reference or f"{path}:{attr}"
    if not path.is_file():
        raise ExperimentError(f"experiment: file not found: {str(path)!r} (from {reference!r})")
    module_spec = importlib.util.spec_from_file_location(experiment_module_name(path), path)
    if module_spec is None or module_spec.loader is None:  # a .py file always has one (the spec's rule)
        raise ExperimentError(f"experiment: {str(path)!r} cannot be imported as a Python module (from {reference!r})")
    module = importlib.util.module_from_spec(module_spec)
    # The experiment's own directory goes on the path so that it can import its neighbours.
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise ExperimentError(
            f"experiment: importing {str(path)!r} failed: {type(exc).__name__}{_where_raised(exc)}: {_message(exc)}"
        ) from None
    finally:
        sys.path.pop(0)
    _EXPERIMENT_MODULES[module_spec.name] = module
    if not hasattr(module, attr):
        found = sorted(name for name, value in vars(module).items() if callable(value) and not name.startswith("_"))
        raise ExperimentError(
            f"experiment: {str(path)!r} has no {attr!r}; callables found: {', '.join(found) or 'none'}"
        )
    target = getattr(module, attr)
    if isinstance(target, type) and issubclass(target, keras_tuner.HyperModel):
        try:
            target = target()
        except Exception as exc:
            raise ExperimentError(f"experiment: {reference}: cannot instantiate the HyperModel: {exc}") from None
    if isinstance(target, keras_tuner.HyperModel):
        return target
    if not callable(target):
        raise ExperimentError(
            f"experiment: {reference} must be a build(hp) function or a keras_tuner.HyperModel, "
            f"got {type(target).__name__}"
        )
    return _BuildFunction(target)


def schedule_text(schedule: Any) -> str:
    """A learning-rate schedule (object or its serialized config) as its class called with the
    arguments that differ from the class's defaults, the initial rate first and unnamed."""
    cls: type | None
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        cls, config = type(schedule), schedule.get_config()
    elif isinstance(schedule, dict) and "class_name" in schedule:
        cls = getattr(keras.optimizers.schedules, schedule["class_name"], None)
        config = schedule.get("config", {})
    else:
        return str(schedule)
    defaults = (
        {}
        if cls is None
        else {name: parameter.default for name, parameter in inspect.signature(cls.__init__).parameters.items()}
    )
    arguments = {
        key: value
        for key, value in config.items()
        if key != "name" and not (key in defaults and defaults[key] == value)
    }
    first = next((key for key in arguments if key.startswith("initial_")), None)
    shown = [_short_number(arguments.pop(first))] if first else []
    shown += [f"{key}={_short_number(value)}" for key, value in arguments.items()]
    return f"{schedule['class_name'] if cls is None else cls.__name__}({', '.join(shown)})"


def _short_number(value: Any) -> str:
    return f"{value:.7g}" if isinstance(value, float) else repr(value) if isinstance(value, str) else str(value)


def _where_raised(exc: BaseException) -> str:
    """' at FILE:LINE (`code`)': the innermost frame of the traceback in the researcher's own
    code (not Keras', TensorFlow's, KerasTuner's or foldsweep's), or '' when none is."""
    package = str(Path(__file__).resolve().parents[1])
    own = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not any(part in frame.filename for part in ("site-packages", "dist-packages", package))
        and not frame.filename.startswith("<")
    ]
    if not own:
        return ""
    frame = own[-1]
    return f" at {frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)"


def _message(exc: BaseException) -> str:
    """An exception's message on one line: Keras' layer errors name the layer's call first and
    the cause next; the arguments it received after them are left out."""
    lines = []
    for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines():
        if line.startswith("Arguments received by"):
            break
        if line.strip():
            lines.append(line.strip())
    return " ".join(lines)


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""
