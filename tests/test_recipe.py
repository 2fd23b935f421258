"""The training recipe (pipeline.engine.recipe): a config turned into training hyperparameters,
a fold's optimizer (the build's own compile or foldsweep's, with the spec's clipping) and its
values for the build, the same way for every trial, rerun and refit."""

from __future__ import annotations

from pathlib import Path

import keras
import pytest
from helpers import MNIST1D_EXPERIMENT, TINY_SPEC, merged

from pipeline.engine.recipe import TrainingParams, TrainingRecipe, optimizer_class, optimizer_recipe
from pipeline.inputs.spec import CLIPPING_ARGUMENTS, OPTIMIZERS, TrainSpec, parse_spec


def params(**changes) -> TrainingParams:
    return TrainingParams(**{"batch_size": 8, "learning_rate": 0.01, "optimizer": "sgd", **changes})


def compiled(optimizer) -> keras.Model:
    """A model its build compiled with ``optimizer`` (never built: only its compile is read)."""
    model = keras.Sequential([keras.layers.Dense(2)])
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    return model


def uncompiled() -> keras.Model:
    return keras.Sequential([keras.layers.Dense(2)])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_foldsweeps_optimizers_are_keras_own_with_the_configs_learning_rate(name):
    recipe = optimizer_recipe(uncompiled(), params(optimizer=name, learning_rate=0.05))
    made = recipe.make([])
    _, fixed = OPTIMIZERS[name]
    assert type(made) is optimizer_class(name) and recipe.name == name and recipe.source == "default"
    assert float(made.learning_rate) == pytest.approx(0.05) and recipe.learning_rate == 0.05
    assert {key: made.get_config()[key] for key in fixed} == dict(fixed)
    assert recipe.clipping == ("none", None)


def test_sgd_is_made_with_momentum_0_9():
    made = optimizer_recipe(None, params(optimizer="sgd")).make([])
    assert isinstance(made, keras.optimizers.SGD) and made.momentum == 0.9


def test_the_recipe_says_whether_the_spec_named_the_optimizer():
    assert optimizer_recipe(uncompiled(), params(), spec_names=frozenset({"learning_rate"})).source == "spec"
    assert optimizer_recipe(uncompiled(), params(), spec_names=frozenset({"batch_size"})).source == "default"


@pytest.mark.parametrize("kind", sorted(CLIPPING_ARGUMENTS))
def test_each_clipping_kind_is_the_keras_argument_that_applies_it(kind):
    recipe = optimizer_recipe(uncompiled(), params(clipping=kind, clip_threshold=0.5))
    assert recipe.clipping == (kind, 0.5)
    argument = CLIPPING_ARGUMENTS[kind]
    assert getattr(recipe.make([]), argument) == 0.5
    others = set(CLIPPING_ARGUMENTS.values()) - {argument}
    assert all(getattr(recipe.make([]), other) is None for other in others)
    # Stacked folds clip each fold's slice themselves: the optimizer then clips nothing.
    assert all(getattr(recipe.make([], clipping=False), value) is None for value in CLIPPING_ARGUMENTS.values())


def test_a_fold_gets_a_fresh_optimizer_each_time():
    recipe = optimizer_recipe(uncompiled(), params())
    assert recipe.make([]) is not recipe.make([])


def test_the_builds_compiled_optimizer_is_kept_unless_the_search_space_names_it():
    model = compiled(keras.optimizers.Adam(learning_rate=0.05, beta_1=0.8))
    own = optimizer_recipe(model, params(learning_rate=0.01))
    assert own.source == "hypermodel" and own.cls is keras.optimizers.Adam and own.name == "adam"
    assert own.learning_rate == 0.05 and own.config["beta_1"] == 0.8
    searched_rate = optimizer_recipe(model, params(learning_rate=0.01), spec_names=frozenset({"learning_rate"}))
    assert searched_rate.cls is keras.optimizers.Adam and searched_rate.learning_rate == 0.01
    assert searched_rate.config["beta_1"] == 0.8
    searched = optimizer_recipe(model, params(optimizer="sgd"), spec_names=frozenset({"optimizer"}))
    assert searched.cls is keras.optimizers.SGD and searched.source == "spec"
    clipped = optimizer_recipe(model, params(clipping="norm", clip_threshold=2.0))
    assert clipped.source == "hypermodel" and clipped.make([]).clipnorm == 2.0


def test_a_clipping_the_search_space_names_is_the_compiled_optimizers_whole_clipping():
    model = compiled(keras.optimizers.SGD(0.3, clipnorm=0.01))
    named = frozenset({"clipping"})
    kept = optimizer_recipe(model, params())  # the spec names no clipping: the compiled one's applies
    assert kept.clipping == ("norm", 0.01) and not kept.clipping_cleared
    cleared = optimizer_recipe(model, params(), spec_names=named)
    assert cleared.clipping == ("none", None) and cleared.clipping_cleared
    assert all(getattr(cleared.make([]), argument) is None for argument in CLIPPING_ARGUMENTS.values())
    by_value = optimizer_recipe(model, params(clipping="value", clip_threshold=1.0), spec_names=named)
    assert by_value.clipping == ("value", 1.0) and by_value.make([]).clipnorm is None
    assert not by_value.clipping_cleared
    unclipped = optimizer_recipe(compiled(keras.optimizers.SGD(0.3)), params(), spec_names=named)
    assert unclipped.clipping == ("none", None) and not unclipped.clipping_cleared


def test_an_optimizer_foldsweep_has_no_name_for_is_named_by_its_class_and_a_schedule_by_its_call():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=1000, decay_rate=0.9)
    recipe = optimizer_recipe(compiled(keras.optimizers.Adagrad(learning_rate=schedule)), params())
    assert recipe.name == "Adagrad"
    assert recipe.learning_rate == "ExponentialDecay(0.01, decay_steps=1000, decay_rate=0.9)"


def test_an_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        optimizer_recipe(uncompiled(), params(optimizer="lion"))


def test_a_config_gives_its_training_hyperparameters_its_build_values_and_its_epochs():
    recipe = TrainingRecipe(TrainSpec(epochs=7))
    config = {
        "batch_size": 16,
        "learning_rate": 0.1,
        "optimizer": "adam",
        "filters": 8,
        "clipping+threshold": {"clipping": "value", "clip_threshold": 0.3},
    }
    resolved = recipe.resolve(config)
    training, build, epochs = resolved.params, resolved.model_values, resolved.epochs
    assert training == TrainingParams(
        batch_size=16, learning_rate=0.1, optimizer="adam", clipping="value", clip_threshold=0.3
    )
    assert build["filters"] == 8 and build["clipping"] == "value" and epochs == 7
    # Unset training hyperparameters take their defaults; a threshold without clipping is dropped.
    resolved = recipe.resolve({"filters": 8, "clip_threshold": 5.0, "epochs": 3})
    training, build, epochs = resolved.params, resolved.model_values, resolved.epochs
    assert training == TrainingParams(
        batch_size=32, learning_rate=1e-3, optimizer="adam", clipping="none", clip_threshold=1.0
    )
    assert "clip_threshold" not in build and epochs == 3


def test_a_hypermodels_fit_arguments_feed_the_training_hyperparameters():
    recipe = TrainingRecipe(TrainSpec(epochs=2), fit_arguments={"batch_size": "bs"})
    resolved = recipe.resolve({"bs": 64})
    training, build = resolved.params, resolved.model_values
    assert training.batch_size == 64 and build["bs"] == 64
    assert recipe.resolve({}).params.batch_size == 32


def spec(tmp_path: Path, **overrides):
    document = merged(TINY_SPEC, {"experiment": f"{MNIST1D_EXPERIMENT}:build", **overrides})
    return parse_spec(document, source_path=tmp_path / "spec.yaml")


def test_the_recipe_from_a_spec_takes_its_train_section_and_the_training_names_its_space_searches(tmp_path):
    swept = spec(
        tmp_path,
        search={"space": {"learning_rate": {"choice": [0.01, 0.1]}, "batch_size": 16}},
        train={"jit_compile": True, "steps_per_launch": 4, "fused": False},
    )
    recipe = TrainingRecipe.from_spec(swept, fit_arguments={"batch_size": "bs"})
    assert recipe.train == swept.train
    assert recipe.spec_names == frozenset({"learning_rate", "batch_size"})
    assert (recipe.choices.jit_compile, recipe.choices.fused, recipe.choices.steps_per_launch) == ("on", "off", 4)
    assert recipe.fit_arguments == {"batch_size": "bs"}


@pytest.mark.parametrize("eager, check_numerics", [(True, False), (False, True)])
def test_eager_runs_and_numeric_checks_are_not_compiled_by_xla(tmp_path, eager, check_numerics):
    recipe = TrainingRecipe.from_spec(
        spec(tmp_path, train={"jit_compile": True}), eager=eager, check_numerics=check_numerics
    )
    assert recipe.choices.jit_compile == "off"
    assert (recipe.choices.eager, recipe.choices.check_numerics) == (eager, check_numerics)
