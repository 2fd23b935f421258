"""A sweep resumed from another directory makes its new trials there (pipeline/engine/relocation.py):
Ray Tune's restore moves the trials it had made, and the search algorithm's saved state would
make the others where the sweep was recorded."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from ray import tune
from ray.tune.experiment import Experiment
from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter, SearchGenerator
from ray.tune.search.optuna import OptunaSearch

from pipeline.engine.relocation import movable

SPACE = {"learning_rate": tune.uniform(1e-3, 1e-1)}


def trainable(config):
    return {"score": config["learning_rate"]}


def basic_variants(fresh: bool):
    return BasicVariantGenerator(random_state=0)


def optuna_tpe(fresh: bool):
    searcher = OptunaSearch(
        space={"learning_rate": optuna.distributions.FloatDistribution(1e-3, 1e-1)}, metric="score", mode="max", seed=0
    )
    # Ray Tune's run wraps a Searcher so; movable does it itself on a resume.
    return searcher if fresh else SearchGenerator(ConcurrencyLimiter(searcher, max_concurrent=1))


@pytest.mark.parametrize("searched_by", [basic_variants, optuna_tpe], ids=["grid and random", "optuna"])
def test_a_restored_search_makes_its_trials_in_the_directory_it_was_resumed_from(tmp_path, searched_by):
    config = {} if searched_by is optuna_tpe else SPACE
    recorded = Experiment("sweep", trainable, config=config, num_samples=3, storage_path=str(tmp_path / "recorded"))
    interrupted = searched_by(fresh=False)
    interrupted.add_configurations([recorded])
    first = interrupted.next_trial()
    interrupted.on_trial_complete(first.trial_id, result={"score": 0.5})
    (tmp_path / "state").mkdir()
    interrupted.save_to_dir(str(tmp_path / "state"), session_str="interrupted")
    moved_to = tmp_path / "moved" / "sweep"

    as_ray_restores_it = searched_by(fresh=False)
    as_ray_restores_it.restore_from_dir(str(tmp_path / "state"))
    resumed = movable(searched_by(fresh=True), str(moved_to), max_concurrent=1)
    resumed.restore_from_dir(str(tmp_path / "state"))

    assert Path(as_ray_restores_it.next_trial().storage.experiment_fs_path) == tmp_path / "recorded" / "sweep"
    second = resumed.next_trial()
    resumed.on_trial_complete(second.trial_id, result={"score": 0.1})
    third = resumed.next_trial()
    assert [Path(trial.storage.experiment_fs_path) for trial in (second, third)] == [moved_to, moved_to]
    assert len({first.trial_id, second.trial_id, third.trial_id}) == 3
    assert resumed.next_trial() is None  # the restored count: 3 samples in all


def test_a_search_algorithm_foldsweep_does_not_make_is_refused_by_name():
    class Hand(tune.search.SearchAlgorithm):
        pass

    with pytest.raises(TypeError, match="a sweep searched by a Hand"):
        movable(Hand(), "/somewhere/sweep", max_concurrent=None)
