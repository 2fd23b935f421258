"""Every place foldsweep reaches into Keras' private API, each a small function or a name of
Keras' private modules: no other module of foldsweep touches a private name of Keras
(``tests/test_private_hooks.py`` checks it).

What each gives users, and the check that it still holds on the installed Keras, is its hook in
``pipeline.base.private_hooks``. Keras is imported inside the functions: the base layer loads as
every command starts, Keras only where a command builds models.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Keras' scikit-learn wrappers, which subclass scikit-learn's estimators as they load: the public
# module and the one Keras' tf.keras compatibility namespace loads.
KERAS_SKLEARN_WRAPPERS = ("keras.wrappers", "keras._tf_keras.keras.wrappers")
# Keras' TensorFlow backend module through which keras.random and the random layers draw, and the
# functions of it foldsweep replaces while it traces its training step (pipeline.engine.draws),
# with the parameters its replacements take.
KERAS_RANDOM_MODULE = "keras.src.backend.tensorflow.random"
KERAS_RANDOM_DRAWS = {
    "dropout": ("inputs", "rate", "noise_shape", "seed"),
    "normal": ("shape", "mean", "stddev", "dtype", "seed"),
    "uniform": ("shape", "minval", "maxval", "dtype", "seed"),
}
# Keras' TensorFlow backend module whose affine image transform (ImageProjectiveTransformV3, which
# XLA cannot compile) foldsweep replaces while it draws (pipeline.engine.image_transforms), with the
# parameters the replacement takes, and the layers that transform images through it.
KERAS_IMAGE_MODULE = "keras.src.backend.tensorflow.image"
AFFINE_TRANSFORM = "affine_transform"
AFFINE_TRANSFORM_PARAMETERS = ("images", "transform", "interpolation", "fill_mode", "fill_value", "data_format")
AFFINE_LAYERS = ("RandomRotation", "RandomTranslation", "RandomZoom")
# Keras' image augmentation layers among them.
AUGMENTATION_LAYERS = ("RandomFlip", "RandomContrast", "RandomBrightness", "RandomCrop", *AFFINE_LAYERS)
# The keras.layers whose every random number comes from those functions with the layer's own
# SeedGenerator, so that foldsweep can draw them (exactly these classes: a subclass may draw otherwise).
COUNTER_DRAWN_LAYERS = (
    "Dropout",
    "SpatialDropout1D",
    "SpatialDropout2D",
    "SpatialDropout3D",
    "GaussianNoise",
    "GaussianDropout",
    "AlphaDropout",
    *AUGMENTATION_LAYERS,
)
# Where Keras' preprocessing layers are defined: of Keras' own layers, only they run ops outside
# the math of a network.
PREPROCESSING_MODULE = "keras.src.layers.preprocessing."


# -- a model's layers -----------------------------------------------------------------------------


def flatten_layers(layer: Any, *, include_self: bool = True, recursive: bool = True) -> list[Any]:
    """Keras' own walk of a layer's (or a model's) layers, in its order: the layer itself first
    with ``include_self``, the layers of nested models too with ``recursive``."""
    return layer._flatten_layers(include_self=include_self, recursive=recursive)


def is_preprocessing_layer(layer: Any) -> bool:
    """Whether ``layer`` is of one of Keras' preprocessing layer classes."""
    return type(layer).__module__.startswith(PREPROCESSING_MODULE)


def layer_graph(model: Any) -> Any:
    """The Functional graph a model runs through (a Sequential's is built with it), or None: a
    subclassed model, a Sequential without an Input."""
    import keras

    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)
    if hasattr(model, "_run_through_graph") and hasattr(model, "_nodes_by_depth"):
        return model
    return None


def run_through_graph(graph: Any, inputs: Any, operation_fn: Callable[[Any], Callable[..., Any]]) -> Any:
    """A ``layer_graph`` run on ``inputs`` with each of its operations called as
    ``operation_fn(operation)`` returns, as Functional.call runs it with the operations themselves."""
    return graph._run_through_graph(inputs, operation_fn=operation_fn)


# -- what compile was given -----------------------------------------------------------------------


def compiled_loss_weights(model: Any) -> Any:
    """The ``loss_weights`` a model was compiled with, or None: Keras keeps them only inside its
    private CompileLoss."""
    return getattr(getattr(model, "_compile_loss", None), "_user_loss_weights", None)


def compile_arguments(model: Any) -> dict[str, Any] | None:
    """The arguments Keras' ``compile`` was last given for ``model``, as given (the objects
    themselves, which ``get_compile_config`` would serialize); None where it was not compiled."""
    held = getattr(model, "_compile_config", None)
    return dict(held.config) if getattr(model, "compiled", False) and held is not None else None


def compiled_metric_arguments(model: Any) -> tuple[list[Any], list[Any]]:
    """The ``metrics`` and ``weighted_metrics`` a model was compiled with (empty when it was not)."""
    compiled = getattr(model, "_compile_metrics", None)
    if compiled is None:
        return [], []
    return list(getattr(compiled, "_user_metrics", None) or []), list(
        getattr(compiled, "_user_weighted_metrics", None) or []
    )


def weight_decay_exclusions(optimizer: Any, variables: Sequence[Any]) -> tuple[int, ...]:
    """The positions in ``variables`` (a model's trainable variables) of those that
    ``optimizer.exclude_from_weight_decay(var_list=, var_names=)`` leaves out, as Keras decides it
    when it applies the decay: a name in ``var_names`` is searched for in the TensorFlow variable's
    full name (``dense_1/kernel:0``). Keras keeps the exclusions out of the optimizer's config."""
    return tuple(k for k, variable in enumerate(variables) if not optimizer._use_weight_decay(variable.value))


def compile_metrics(metrics: list[Any], weighted_metrics: list[Any]) -> Any:
    """Keras' ``CompileMetrics`` of those ``compile`` arguments: what ``compile`` builds, with its
    ``build``, ``update_state``, ``result`` and ``reset_state``."""
    from keras.src.trainers.compile_utils import CompileMetrics

    return CompileMetrics(metrics, weighted_metrics)


# -- random layers --------------------------------------------------------------------------------


def holds_seed_generator(layer: object) -> bool:
    """Whether a Keras layer draws random numbers: it holds a SeedGenerator, Dropout and the noise
    layers as ``seed_generator``, the augmentation layers (RandomFlip...) as ``generator``."""
    from keras.random import SeedGenerator

    return any(isinstance(value, SeedGenerator) for value in vars(layer).values())


def seed_generator_of(layer: object) -> Any:
    """The SeedGenerator a Keras random layer draws from (``holds_seed_generator``), or None."""
    from keras.random import SeedGenerator

    return next((value for value in vars(layer).values() if isinstance(value, SeedGenerator)), None)


def counter_drawn(layer: object) -> bool:
    """Whether foldsweep can draw a Keras layer's random numbers (``COUNTER_DRAWN_LAYERS``)."""
    import keras

    return any(type(layer) is getattr(keras.layers, name) for name in COUNTER_DRAWN_LAYERS)


def backend_draws() -> dict[str, Callable[..., Any]]:
    """The functions of Keras' TensorFlow backend that the ``COUNTER_DRAWN_LAYERS`` look up at each
    draw, as they are now, by name: ``KERAS_RANDOM_DRAWS``' and ``AFFINE_TRANSFORM``."""
    random, image = importlib.import_module(KERAS_RANDOM_MODULE), importlib.import_module(KERAS_IMAGE_MODULE)
    return {
        **{name: getattr(random, name) for name in KERAS_RANDOM_DRAWS},
        AFFINE_TRANSFORM: getattr(image, AFFINE_TRANSFORM),
    }


def replace_backend_draws(functions: Mapping[str, Callable[..., Any]]) -> None:
    """Put ``functions`` in place of those of ``backend_draws`` of the same names."""
    random, image = importlib.import_module(KERAS_RANDOM_MODULE), importlib.import_module(KERAS_IMAGE_MODULE)
    for name, function in functions.items():
        setattr(image if name == AFFINE_TRANSFORM else random, name, function)
