"""Search space details: clipping, conditional scopes, grid and Optuna searchers, schedulers."""

from __future__ import annotations

import keras
import pytest
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, MedianStoppingRule

from conftest import DELETE, MNIST1D_EXPERIMENT, Replace
from pipeline.base.errors import SpecError
from pipeline.inputs.hypermodel import load_experiment
from pipeline.inputs.space import CLIP_PAIR, build_space, resolve_config
from pipeline.inputs.spec import load_spec
from pipeline.sweep import make_scheduler, make_searcher
from pipeline.engine.recipe import TrainingParams, make_optimizer

CONDITIONAL = '''
import keras

def build(hp):
    inputs = keras.Input((40, 1))
    x = inputs
    block = hp.Choice("block", ["conv", "dense"])
    with hp.conditional_scope("block", ["conv"]):
        if block == "conv":
            x = keras.layers.Conv1D(hp.Int("conv_filters", 4, 8, step=4), 3)(x)
    with hp.conditional_scope("block", ["dense"]):
        if block == "dense":
            x = keras.layers.Dense(hp.Int("dense_units", 4, 8, step=4))(x)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(x))
'''

CONTINUOUS = '''
import keras

def build(hp):
    inputs = keras.Input((40, 1))
    x = keras.layers.Dropout(hp.Float("rate", 0.0, 0.5))(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(x))
'''


@pytest.fixture(scope="module")
def mnist1d_hps():
    return load_experiment(MNIST1D_EXPERIMENT, "build").hyperparameters


@pytest.mark.parametrize(("clipping", "argument"), [
    ("norm", "clipnorm"), ("value", "clipvalue"), ("global_norm", "global_clipnorm")])
def test_each_clipping_kind_sets_its_keras_argument(clipping, argument):
    optimizer = make_optimizer(TrainingParams(8, 1e-3, "adam", clipping=clipping, clip_threshold=0.5))
    assert getattr(optimizer, argument) == 0.5
    others = {"clipnorm", "clipvalue", "global_clipnorm"} - {argument}
    assert all(getattr(optimizer, other) is None for other in others)


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "rmsprop"])
def test_no_clipping_sets_no_clipping_argument(name):
    optimizer = make_optimizer(TrainingParams(8, 1e-3, name, clipping="none", clip_threshold=None))
    assert (optimizer.clipnorm, optimizer.clipvalue, optimizer.global_clipnorm) == (None, None, None)
    assert float(optimizer.learning_rate) == pytest.approx(1e-3)


def test_sgd_has_momentum():
    assert make_optimizer(TrainingParams(8, 1e-2, "sgd")).momentum == 0.9


def test_clipping_grid_pairs_thresholds_only_with_clipping(write_spec, mnist1d_hps):
    spec = load_spec(write_spec({"search": {"space": {
        "clipping": {"grid": ["none", "norm", "value"]}, "clip_threshold": {"grid": [0.5, 1.0]}}}}))
    pairs = build_space(spec, mnist1d_hps).param_space[CLIP_PAIR]["grid_search"]
    assert pairs == [
        {"clipping": "none", "clip_threshold": None},
        {"clipping": "norm", "clip_threshold": 0.5}, {"clipping": "norm", "clip_threshold": 1.0},
        {"clipping": "value", "clip_threshold": 0.5}, {"clipping": "value", "clip_threshold": 1.0},
    ]
    assert build_space(spec, mnist1d_hps).trial_count(2) == 10
    assert resolve_config({CLIP_PAIR: pairs[1], "filters": 16}) == {
        "clipping": "norm", "clip_threshold": 0.5, "filters": 16}


def test_threshold_is_dropped_when_clipping_is_off():
    assert "clip_threshold" not in resolve_config({"clipping": "none", "clip_threshold": 3.0})


def test_conditional_scopes_are_discovered_and_inactive_values_dropped(write_spec, write_experiment):
    experiment = load_experiment(write_experiment(CONDITIONAL), "build")
    spec = load_spec(write_spec({"experiment": f"{experiment.reference}", "search": {"space": Replace({})}}))
    space = build_space(spec, experiment.hyperparameters)
    assert set(space.conditions) == {"clip_threshold", "conv_filters", "dense_units"}
    used = space.resolve({"block": "dense", "conv_filters": 8, "dense_units": 4})
    assert "conv_filters" not in used and used["dense_units"] == 4
    model = experiment.build(used)
    assert any(isinstance(layer, keras.layers.Dense) and layer.units == 4 for layer in model.layers)


def test_grid_search_enumerates_finite_spaces_and_refuses_continuous_ones(write_spec, write_experiment,
                                                                          mnist1d_hps):
    spec = load_spec(write_spec({"search": {"algorithm": "grid"}}))
    space = build_space(spec, mnist1d_hps).param_space
    assert space["kernel_size"] == {"grid_search": [3, 5]}
    assert space["dropout"] == {"grid_search": [0.0, 0.1, 0.2, 0.3, 0.4]}
    continuous = load_experiment(write_experiment(CONTINUOUS), "build")
    spec = load_spec(write_spec({"search": {"algorithm": "grid", "space": Replace({})}}))
    with pytest.raises(SpecError, match="grid needs finite values, but hyperparameter 'rate' .* is continuous"):
        build_space(spec, continuous.hyperparameters)


@pytest.mark.parametrize(("search", "message"), [
    ({"algorithm": "grid", "space": {"learning_rate": {"loguniform": [1e-4, 1e-2]}}},
     "search.space.learning_rate must be a fixed value, choice or grid when search.algorithm is grid"),
    ({"algorithm": "optuna", "space": {"batch_size": {"grid": [8, 16]}}},
     "search.space.batch_size cannot be a grid with search.algorithm optuna"),
    ({"space": {"clipping": "clip"}}, "search.space.clipping must be one of none, norm, value, global_norm"),
    ({"space": {"clipping": {"choice": ["none", "nrom"]}}}, "(did you mean 'norm'?), got 'nrom'"),
    ({"space": {"clip_threshold": 0}}, "search.space.clip_threshold must be a number > 0 (every value it takes), got 0"),
    ({"space": {"epochs": {"choice": [2, 0]}}}, "search.space.epochs must be a positive integer (every value it takes), got 0"),
    ({"scheduler": "hyperband"}, "search.scheduler must be one of fifo, asha, median"),
    ({"scheduler": {"name": "asha", "reduction_factor": 1}}, "search.scheduler.reduction_factor must be an integer >= 2, got 1"),
    ({"scheduler": {"name": "asha", "grace": 1}}, "unknown key 'search.scheduler.grace' (did you mean 'grace_period'?)"),
    ({"scheduler": {"name": "asha", "grace_period": 3}}, "search.scheduler.grace_period must be below the epochs a "
     "trial trains (train.epochs: at most 2), or asha can never stop a trial early, got grace_period=3"),
    ({"scheduler": {"name": "median", "grace_period": 4}, "space": {"epochs": {"choice": [2, 4]}}},
     "search.scheduler.grace_period must be below the epochs a trial trains (search.space.epochs: at most 4)"),
])
def test_search_rules(write_spec, search, message):
    with pytest.raises(SpecError) as caught:
        load_spec(write_spec({"search": search}))
    assert message in str(caught.value)


def test_schedulers_are_built_from_the_spec(write_spec):
    assert isinstance(make_scheduler(load_spec(write_spec())), FIFOScheduler)
    asha = make_scheduler(load_spec(write_spec({"search": {"scheduler": {"name": "asha", "grace_period": 2}},
                                                "train": {"epochs": 3}})))
    assert isinstance(asha, ASHAScheduler) and asha._max_t == 3
    assert isinstance(make_scheduler(load_spec(write_spec({"search": {"scheduler": "median"}}))), MedianStoppingRule)


def test_grid_and_random_search_carry_the_concurrency_limit_themselves(write_spec, mnist1d_hps):
    """Ray Tune applies max_concurrent_trials to a Searcher only: a BasicVariantGenerator handed
    to it without its own limit ran every trial the CPUs allowed."""
    spec = load_spec(write_spec({"resources": {"max_concurrent": 1}}))
    assert make_searcher(spec, build_space(spec, mnist1d_hps)).max_concurrent == 1
    unlimited = load_spec(write_spec({"resources": {"max_concurrent": DELETE}}))
    assert make_searcher(unlimited, build_space(unlimited, mnist1d_hps)).max_concurrent == 0


def optuna_suggestions(spec, hps, count=5):
    searcher = make_searcher(spec, build_space(spec, hps))
    return [searcher.suggest(f"trial_{i}") for i in range(count)]


def test_optuna_tpe_with_a_seed_proposes_the_same_configs_and_no_threshold_without_clipping(write_spec, mnist1d_hps):
    overrides = {"search": {"algorithm": "optuna", "seed": 7, "space": {
        "learning_rate": {"loguniform": [1e-4, 1e-1]}, "clipping": {"choice": ["none", "norm"]},
        "clip_threshold": {"loguniform": [0.1, 10.0]}}}}
    spec = load_spec(write_spec(overrides))
    first = optuna_suggestions(spec, mnist1d_hps)
    assert first == optuna_suggestions(spec, mnist1d_hps)
    other = load_spec(write_spec({**overrides, "search": {**overrides["search"], "seed": 8}}))
    assert optuna_suggestions(other, mnist1d_hps) != first
    for config in first:
        assert ("clip_threshold" in config) == (config["clipping"] != "none")
        assert config["filters"] == 16 and config["kernel_size"] in (3, 5)
