"""Search space details: clipping, conditional scopes, grid, random and Optuna searchers (none makes a
config twice), schedulers."""

from __future__ import annotations

import keras
import optuna
import pytest
from helpers import DELETE, MNIST1D_EXPERIMENT, Replace
from ray.tune.experiment import Experiment
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, MedianStoppingRule
from ray.tune.search import BasicVariantGenerator, Searcher

from pipeline.base.errors import SpecError
from pipeline.engine.recipe import TrainingParams, optimizer_recipe
from pipeline.engine.relocation import movable
from pipeline.engine.stacked import clip_per_fold
from pipeline.inputs import searchers
from pipeline.inputs import space as space_module
from pipeline.inputs.hypermodel import load_experiment
from pipeline.inputs.space import CLIP_PAIR, build_space, config_key, resolve_config
from pipeline.inputs.spec import CLIPPING_KINDS, NO_CLIPPING, OPTIMIZERS, load_spec
from pipeline.sweep import make_scheduler, make_searcher

CONDITIONAL = """
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
"""

CONTINUOUS = """
import keras

def build(hp):
    inputs = keras.Input((40, 1))
    x = keras.layers.Dropout(hp.Float("rate", 0.0, 0.5))(keras.layers.Flatten()(inputs))
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(x))
"""


@pytest.fixture(scope="module")
def mnist1d_hps():
    return load_experiment(MNIST1D_EXPERIMENT, "build").hyperparameters


@pytest.mark.parametrize(
    ("clipping", "argument"), [("norm", "clipnorm"), ("value", "clipvalue"), ("global_norm", "global_clipnorm")]
)
def test_each_clipping_kind_sets_its_keras_argument(clipping, argument):
    optimizer = optimizer_recipe(None, TrainingParams(8, 1e-3, "adam", clipping=clipping, clip_threshold=0.5)).make([])
    assert getattr(optimizer, argument) == 0.5
    others = {"clipnorm", "clipvalue", "global_clipnorm"} - {argument}
    assert all(getattr(optimizer, other) is None for other in others)


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "rmsprop"])
def test_no_clipping_sets_no_clipping_argument(name):
    optimizer = optimizer_recipe(None, TrainingParams(8, 1e-3, name, clipping="none", clip_threshold=None)).make([])
    assert (optimizer.clipnorm, optimizer.clipvalue, optimizer.global_clipnorm) == (None, None, None)
    assert float(optimizer.learning_rate) == pytest.approx(1e-3)


def test_every_optimizer_and_clipping_kind_the_spec_allows_is_made():
    """The spec's tables (``OPTIMIZERS``, ``CLIPPING_KINDS``) are what the recipe and the stacked
    step read: each name makes its optimizer and each kind reads back as itself."""
    for name in OPTIMIZERS:
        recipe = optimizer_recipe(None, TrainingParams(8, 1e-3, name))
        assert isinstance(recipe.make([]), keras.optimizers.Optimizer) and recipe.name == name
    for kind in CLIPPING_KINDS:
        threshold = None if kind == NO_CLIPPING else 0.5
        assert optimizer_recipe(
            None, TrainingParams(8, 1e-3, "adam", clipping=kind, clip_threshold=threshold)
        ).clipping == (kind, threshold)
        assert callable(clip_per_fold(kind, threshold))


def test_sgd_has_momentum():
    assert optimizer_recipe(None, TrainingParams(8, 1e-2, "sgd")).make([]).momentum == 0.9


def test_clipping_grid_pairs_thresholds_only_with_clipping(write_spec, mnist1d_hps):
    spec = load_spec(
        write_spec(
            {
                "search": {
                    "space": {"clipping": {"grid": ["none", "norm", "value"]}, "clip_threshold": {"grid": [0.5, 1.0]}}
                }
            }
        )
    )
    pairs = build_space(spec, mnist1d_hps).param_space[CLIP_PAIR]["grid_search"]
    assert pairs == [
        {"clipping": "none", "clip_threshold": None},
        {"clipping": "norm", "clip_threshold": 0.5},
        {"clipping": "norm", "clip_threshold": 1.0},
        {"clipping": "value", "clip_threshold": 0.5},
        {"clipping": "value", "clip_threshold": 1.0},
    ]
    assert build_space(spec, mnist1d_hps).trial_count(2) == 10
    assert resolve_config({CLIP_PAIR: pairs[1], "filters": 16}) == {
        "clipping": "norm",
        "clip_threshold": 0.5,
        "filters": 16,
    }


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


def test_grid_search_enumerates_finite_spaces_and_refuses_continuous_ones(write_spec, write_experiment, mnist1d_hps):
    spec = load_spec(write_spec({"search": {"algorithm": "grid"}}))
    space = build_space(spec, mnist1d_hps).param_space
    assert space["kernel_size"] == {"grid_search": [3, 5]}
    assert space["dropout"] == {"grid_search": [0.0, 0.1, 0.2, 0.3, 0.4]}
    continuous = load_experiment(write_experiment(CONTINUOUS), "build")
    spec = load_spec(write_spec({"search": {"algorithm": "grid", "space": Replace({})}}))
    with pytest.raises(SpecError, match="grid needs finite values, but hyperparameter 'rate' .* is continuous"):
        build_space(spec, continuous.hyperparameters)


@pytest.mark.parametrize(
    ("search", "message"),
    [
        (
            {"algorithm": "grid", "space": {"learning_rate": {"loguniform": [1e-4, 1e-2]}}},
            "search.space.learning_rate must be a fixed value, choice or grid when search.algorithm is grid",
        ),
        (
            {"algorithm": "optuna", "space": {"batch_size": {"grid": [8, 16]}}},
            "search.space.batch_size cannot be a grid with search.algorithm optuna",
        ),
        ({"space": {"clipping": "clip"}}, "search.space.clipping must be one of none, norm, value, global_norm"),
        ({"space": {"clipping": {"choice": ["none", "nrom"]}}}, "(did you mean 'norm'?), got 'nrom'"),
        (
            {"space": {"clip_threshold": 0}},
            "search.space.clip_threshold must be a number > 0 (every value it takes), got 0",
        ),
        (
            {"space": {"epochs": {"choice": [2, 0]}}},
            "search.space.epochs must be a positive integer (every value it takes), got 0",
        ),
        ({"scheduler": "hyperband"}, "search.scheduler must be one of fifo, asha, median"),
        (
            {"scheduler": {"name": "asha", "reduction_factor": 1}},
            "search.scheduler.reduction_factor must be an integer >= 2, got 1",
        ),
        (
            {"scheduler": {"name": "asha", "grace": 1}},
            "unknown key 'search.scheduler.grace' (did you mean 'grace_period'?)",
        ),
        (
            {"scheduler": {"name": "asha", "grace_period": 3}},
            "search.scheduler.grace_period must be below the epochs a "
            "trial trains (train.epochs: at most 2), or asha can never stop a trial early, got grace_period=3",
        ),
        (
            {"scheduler": {"name": "median", "grace_period": 4}, "space": {"epochs": {"choice": [2, 4]}}},
            "search.scheduler.grace_period must be below the epochs a trial trains (search.space.epochs: at most 4)",
        ),
    ],
)
def test_search_rules(write_spec, search, message):
    with pytest.raises(SpecError) as caught:
        load_spec(write_spec({"search": search}))
    assert message in str(caught.value)


def test_schedulers_are_built_from_the_spec(write_spec):
    assert isinstance(make_scheduler(load_spec(write_spec())), FIFOScheduler)
    asha = make_scheduler(
        load_spec(write_spec({"search": {"scheduler": {"name": "asha", "grace_period": 2}}, "train": {"epochs": 3}}))
    )
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
    overrides = {
        "search": {
            "algorithm": "optuna",
            "seed": 7,
            "space": {
                "learning_rate": {"loguniform": [1e-4, 1e-1]},
                "clipping": {"choice": ["none", "norm"]},
                "clip_threshold": {"loguniform": [0.1, 10.0]},
            },
        }
    }
    spec = load_spec(write_spec(overrides))
    first = optuna_suggestions(spec, mnist1d_hps)
    assert first == optuna_suggestions(spec, mnist1d_hps)
    other = load_spec(write_spec({**overrides, "search": {**overrides["search"], "seed": 8}}))
    assert optuna_suggestions(other, mnist1d_hps) != first
    for config in first:
        assert ("clip_threshold" in config) == (config["clipping"] != "none")
        assert config["filters"] == 16 and config["kernel_size"] in (3, 5)


# 2 x 2 x 2 = 8 configs: the model's other hyperparameters fixed.
EIGHT_CONFIGS = {
    "conv_layers": 1,
    "filters": 16,
    "kernel_size": {"choice": [3, 5]},
    "dropout": {"choice": [0.0, 0.1]},
    "batch_size": {"choice": [8, 16]},
}


def trainable(config):
    return {"accuracy": 0.5}


def tuner_trials(searcher, space, num_samples, storage, *, stop_after=None):
    """The trials a searcher makes, asked as Ray Tune's TuneController asks: the experiment added,
    then next_trial until there is none (or ``stop_after``), each trial ended before the next."""
    searcher.add_configurations(
        [Experiment("sweep", trainable, config=space.param_space, num_samples=num_samples, storage_path=str(storage))]
    )
    return made_trials(searcher, stop_after)


def made_trials(searcher, stop_after=None):
    trials = []
    while (stop_after is None or len(trials) < stop_after) and (trial := searcher.next_trial()) is not None:
        searcher.on_trial_complete(trial.trial_id, result={"accuracy": 0.5})
        trials.append(trial)
    return trials


def searched_values(space, trials):
    """Each trial's config as the trial uses it, its searched values only."""
    searched = set(space.searched())
    return [
        {name: value for name, value in space.resolve(trial.config).items() if name in searched} for trial in trials
    ]


def random_search(write_spec, hps, tmp_path, space, num_samples, **search):
    spec = load_spec(write_spec({"search": {"num_samples": num_samples, "space": Replace(space), **search}}))
    built = build_space(spec, hps)
    trials = tuner_trials(make_searcher(spec, built), built, num_samples, tmp_path / "ray")
    return built, searched_values(built, trials)


def distinct(configs):
    return {config_key(config) for config in configs}


def test_random_search_over_eight_configs_with_eight_samples_trains_all_eight(write_spec, mnist1d_hps, tmp_path):
    space, configs = random_search(write_spec, mnist1d_hps, tmp_path, EIGHT_CONFIGS, 8)
    assert space.trial_count(8) == len(configs) == len(distinct(configs)) == 8
    assert space.repeats_notice(8) is None


def test_more_samples_than_configs_runs_each_once_and_says_so(write_spec, mnist1d_hps, tmp_path):
    space, configs = random_search(write_spec, mnist1d_hps, tmp_path, EIGHT_CONFIGS, 12)
    assert space.trial_count(12) == len(configs) == len(distinct(configs)) == 8
    assert space.repeats_notice(12) == (
        "search.num_samples 12 exceeds the 8 distinct configs of the search space: each runs once (8 trials); "
        "search.algorithm: grid enumerates them"
    )
    assert "--num-samples 12 exceeds" in space.repeats_notice(12, source="--num-samples")


def test_validate_counts_the_distinct_configs_and_says_why(write_spec):
    from typer.testing import CliRunner

    from pipeline.cli import app

    result = CliRunner().invoke(
        app, ["validate", str(write_spec({"search": {"num_samples": 12, "space": Replace(EIGHT_CONFIGS)}}))]
    )
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "random search, 8 trials" in output
    assert "notice: search.num_samples 12 exceeds the 8 distinct configs of the search space" in output


def test_a_threshold_without_clipping_makes_no_new_config(write_spec, mnist1d_hps, tmp_path):
    """clipping none once per kernel size, norm with each threshold: 2 x (1 + 2) = 6 configs, at
    each of the grid's two batch sizes."""
    space = {
        "conv_layers": 1,
        "filters": 16,
        "dropout": 0.0,
        "kernel_size": {"choice": [3, 5]},
        "clipping": {"choice": ["none", "norm"]},
        "clip_threshold": {"choice": [0.5, 1.0]},
        "batch_size": {"grid": [8, 16]},
    }
    built, configs = random_search(write_spec, mnist1d_hps, tmp_path, space, 10)
    assert built.trial_count(10) == len(configs) == len(distinct(configs)) == 12
    for batch_size in (8, 16):
        at_point = [config for config in configs if config["batch_size"] == batch_size]
        assert sorted((c["kernel_size"], c["clipping"], c.get("clip_threshold", 0)) for c in at_point) == [
            (3, "none", 0),
            (3, "norm", 0.5),
            (3, "norm", 1.0),
            (5, "none", 0),
            (5, "norm", 0.5),
            (5, "norm", 1.0),
        ]
    assert built.repeats_notice(10) == (
        "search.num_samples 10 at each of the 2 grid points would repeat configs: they make 12 distinct ones, and "
        "each runs once (12 trials, not 20)"
    )


def test_grid_search_runs_a_conditional_scope_once_per_config(write_spec, write_experiment, tmp_path):
    """block x conv_filters x dense_units is 8 grid points, but only 4 configs: conv_filters
    counts only for conv blocks, dense_units only for dense ones."""
    experiment = load_experiment(write_experiment(CONDITIONAL), "build")
    spec = load_spec(
        write_spec(
            {
                "experiment": experiment.reference,
                "search": {"algorithm": "grid", "num_samples": 1, "space": Replace({})},
            }
        )
    )
    space = build_space(spec, experiment.hyperparameters)
    configs = searched_values(space, tuner_trials(make_searcher(spec, space), space, 1, tmp_path / "ray"))
    assert sorted(map(config_key, configs)) == sorted(
        map(
            config_key,
            [
                {"block": "conv", "conv_filters": 4},
                {"block": "conv", "conv_filters": 8},
                {"block": "dense", "dense_units": 4},
                {"block": "dense", "dense_units": 8},
            ],
        )
    )
    assert space.trial_count(1) == 4 and space.trial_count(3) == 4
    assert space.repeats_notice(1).startswith("the 8 grid points make 4 distinct configs")


def test_configs_rarely_drawn_are_taken_in_order_after_enough_rounds(write_spec, mnist1d_hps, tmp_path, monkeypatch):
    """A space whose last configs Ray Tune's draws keep missing still runs each config once."""
    monkeypatch.setattr(space_module, "ROUNDS_PER_SAMPLE", 0)
    space, configs = random_search(write_spec, mnist1d_hps, tmp_path, EIGHT_CONFIGS, 12)
    assert len(configs) == len(distinct(configs)) == 8


def test_the_same_seed_draws_the_same_configs_and_another_seed_others(write_spec, mnist1d_hps, tmp_path):
    _, first = random_search(write_spec, mnist1d_hps, tmp_path / "a", EIGHT_CONFIGS, 5, seed=3)
    _, again = random_search(write_spec, mnist1d_hps, tmp_path / "b", EIGHT_CONFIGS, 5, seed=3)
    _, other = random_search(write_spec, mnist1d_hps, tmp_path / "c", EIGHT_CONFIGS, 5, seed=4)
    assert first == again and first != other


@pytest.mark.parametrize(
    "space",
    [
        {"learning_rate": {"loguniform": [1e-4, 1e-2]}, "batch_size": {"grid": [8, 16]}},
        {**EIGHT_CONFIGS, "learning_rate": {"loguniform": [1e-4, 1e-2]}},
    ],
    ids=["continuous with a grid", "finite and continuous"],
)
def test_a_space_that_cannot_repeat_a_config_draws_what_ray_tune_drew(write_spec, mnist1d_hps, tmp_path, space):
    """Sweeps recorded before draws were kept distinct draw the same configs from the same seed."""
    spec = load_spec(write_spec({"search": {"num_samples": 6, "seed": 5, "space": Replace(space)}}))
    built = build_space(spec, mnist1d_hps)
    ours = tuner_trials(make_searcher(spec, built), built, 6, tmp_path / "ours")
    rays = tuner_trials(BasicVariantGenerator(random_state=5), built, 6, tmp_path / "rays")
    assert [trial.config for trial in ours] == [trial.config for trial in rays]
    assert [trial.experiment_tag for trial in ours] == [trial.experiment_tag for trial in rays]


def test_a_finite_space_draws_what_ray_tune_drew_up_to_its_first_repeat(write_spec, mnist1d_hps, tmp_path):
    spec = load_spec(write_spec({"search": {"num_samples": 8, "space": Replace(EIGHT_CONFIGS)}}))
    space = build_space(spec, mnist1d_hps)
    ours = searched_values(space, tuner_trials(make_searcher(spec, space), space, 8, tmp_path / "ours"))
    rays = searched_values(space, tuner_trials(BasicVariantGenerator(random_state=0), space, 8, tmp_path / "rays"))
    first_repeat = next(index for index, config in enumerate(rays) if config in rays[:index])
    assert first_repeat >= 2 and ours[:first_repeat] == rays[:first_repeat]
    assert len(distinct(ours)) == 8 > len(distinct(rays))


def test_a_resumed_random_search_makes_the_configs_it_had_not_made(write_spec, mnist1d_hps, tmp_path):
    """Ray Tune saves the searcher's state and restores it into the searcher it unpickled, which
    a resume makes movable (pipeline.engine.relocation)."""
    spec = load_spec(write_spec({"search": {"num_samples": 8, "space": Replace(EIGHT_CONFIGS)}}))
    space = build_space(spec, mnist1d_hps)
    interrupted = make_searcher(spec, space)
    before = tuner_trials(interrupted, space, 8, tmp_path / "ray", stop_after=3)
    (tmp_path / "state").mkdir()
    interrupted.save_to_dir(str(tmp_path / "state"), session_str="interrupted")

    resumed = movable(make_searcher(spec, space), str(tmp_path / "moved" / "sweep"), max_concurrent=1)
    resumed.restore_from_dir(str(tmp_path / "state"))
    after = made_trials(resumed)

    assert len(before) == 3 and len(after) == 5
    assert len(distinct(searched_values(space, before + after))) == 8


def optuna_configs(spec, space, count):
    """What Optuna suggests, each trial told a score before the next is asked (``FINISHED`` ends)."""
    searcher = make_searcher(spec, space)
    configs = []
    for index in range(count):
        config = searcher.suggest(f"trial_{index}")
        if config is Searcher.FINISHED:
            break
        configs.append({name: value for name, value in space.resolve(config).items() if name in space.searched()})
        searcher.on_trial_complete(f"trial_{index}", result={spec.objective.key: 0.1 * (index % 3)})
    return configs


@pytest.mark.parametrize(
    "repeats", [searchers.REPEATS_BEFORE_A_NEW_CONFIG, 1], ids=["patient", "given untried configs"]
)
@pytest.mark.parametrize("num_samples", [6, 12])
def test_optuna_never_suggests_a_config_twice_and_finishes_when_all_were(
    write_spec, mnist1d_hps, monkeypatch, num_samples, repeats
):
    """Optuna's TPE proposes configs it proposed before (4 to 6 distinct of 8 with seeds 0-4):
    they are answered without training, and after all 8 the search is finished."""
    monkeypatch.setattr(searchers, "REPEATS_BEFORE_A_NEW_CONFIG", repeats)
    spec = load_spec(
        write_spec(
            {"search": {"algorithm": "optuna", "num_samples": num_samples, "seed": 0, "space": Replace(EIGHT_CONFIGS)}}
        )
    )
    space = build_space(spec, mnist1d_hps)
    configs = optuna_configs(spec, space, num_samples)
    assert len(configs) == len(distinct(configs)) == space.trial_count(num_samples) == min(num_samples, 8)
    assert configs == optuna_configs(spec, space, num_samples)


def test_optuna_learns_each_score_with_the_config_that_earned_it(write_spec, mnist1d_hps):
    """A config Optuna proposed after repeating itself is learned with its trial's score: the
    repeated proposals are failed, the trial's result goes to the proposal that made its config."""
    spec = load_spec(
        write_spec({"search": {"algorithm": "optuna", "num_samples": 8, "seed": 0, "space": Replace(EIGHT_CONFIGS)}})
    )
    space = build_space(spec, mnist1d_hps)
    searcher = make_searcher(spec, space)
    scored = []
    for index in range(8):
        config = searcher.suggest(f"trial_{index}")
        searcher.on_trial_complete(f"trial_{index}", result={searcher.metric: 0.01 * index})
        scored.append((0.01 * index, config))
    study = searcher.proposing.study
    learned = [trial for trial in study.trials if trial.state == optuna.trial.TrialState.COMPLETE]
    assert [(trial.value, trial.params) for trial in learned] == [
        (score, {name: config[name] for name in trial.params}) for (score, config), trial in zip(scored, learned)
    ]
    assert len(learned) == len(scored)
    assert any(trial.state == optuna.trial.TrialState.FAIL for trial in study.trials), "Optuna repeated itself"


def test_a_restored_optuna_search_gives_a_trials_score_to_the_proposal_of_its_config(write_spec, mnist1d_hps, tmp_path):
    """As a resumed sweep restores it: a trial whose config came after a repeat ends after the
    restore, and Optuna learns its score with that config."""
    spec = load_spec(
        write_spec({"search": {"algorithm": "optuna", "num_samples": 8, "seed": 0, "space": Replace(EIGHT_CONFIGS)}})
    )
    space = build_space(spec, mnist1d_hps)
    searcher = make_searcher(spec, space)
    for index in range(8):
        config = searcher.suggest(f"trial_{index}")
        if f"trial_{index}" in searcher.proposal_of:
            break
        searcher.on_trial_complete(f"trial_{index}", result={searcher.metric: 0.01 * index})
    else:
        pytest.fail("Optuna never repeated itself in 8 trials of a space of 8")
    searcher.save(str(tmp_path / "searcher.pkl"))
    restored = make_searcher(spec, space)
    restored.restore(str(tmp_path / "searcher.pkl"))
    restored.on_trial_complete(f"trial_{index}", result={restored.metric: 0.5})
    (learned,) = [trial for trial in restored.proposing.study.trials if trial.value == 0.5]
    assert learned.state == optuna.trial.TrialState.COMPLETE
    assert learned.params == {name: config[name] for name in learned.params}
