"""Ray Tune's searchers, made never to suggest a config twice: random and grid search draw from the
``SearchSpace``; Optuna TPE is asked again when it proposes a config it proposed before.

Imports Ray Tune's search modules (``pipeline.sweep`` imports this one when it builds a Tuner).
"""

from __future__ import annotations

from typing import Any

from ray.tune.search import Searcher
from ray.tune.search.basic_variant import BasicVariantGenerator
from ray.tune.search.optuna import OptunaSearch

from pipeline.base.ray_private import add_drawn_trials, enqueue_optuna_config, fail_optuna_proposal
from pipeline.inputs.space import SearchSpace, config_key

# Proposals of configs already suggested that Optuna may make in a row before the next config not
# yet tried is given to it (a TPE that has settled on a few configs proposes them again and again).
REPEATS_BEFORE_A_NEW_CONFIG = 10


class DistinctVariantGenerator(BasicVariantGenerator):
    """Ray Tune's BasicVariantGenerator (random search, grid entries enumerated), whose trials are
    the space's ``draw``: Ray Tune's own draws from the same seed, without a repeated config, as
    many as ``SearchSpace.trial_count`` says.

    Its state is Ray Tune's (the drawn variants not yet made into trials), saved and restored as
    Ray Tune does for a resumed sweep."""

    def __init__(self, space: SearchSpace, *, seed: int | None, max_concurrent: int = 0):
        super().__init__(random_state=seed, max_concurrent=max_concurrent)
        self.space = space

    def add_configurations(self, experiments: Any) -> None:
        add_drawn_trials(
            self,
            experiments,
            lambda spec, num_samples, random_state: self.space.draw(
                spec, num_samples=num_samples, random_state=random_state
            ),
        )


class DistinctOptunaSearch(OptunaSearch):
    """Ray Tune's OptunaSearch over the space's define-by-run function, which never suggests a
    config twice. A repeated proposal is not trained: Optuna is told it failed (TPE leaves failed
    trials out of what it learns, so nothing is learned twice) and asked again; after
    ``REPEATS_BEFORE_A_NEW_CONFIG`` such proposals in a row it is given the first config not yet
    tried, and when none is left the search is finished. So a sweep runs
    ``SearchSpace.trial_count`` trials, as random search does."""

    def __init__(self, space: SearchSpace, **kwargs: Any):
        super().__init__(space=space.optuna_define_by_run(), **kwargs)
        self.search_space = space
        self.suggested: set[str] = set()  # the keys of the configs suggested

    # Ray annotates suggest as returning a dict or None, but documents (and takes) Searcher.FINISHED.
    def suggest(self, trial_id: str) -> dict | str | None:  # type: ignore[override]
        for _ in range(REPEATS_BEFORE_A_NEW_CONFIG):
            config = super().suggest(trial_id)
            if config is None:  # Optuna has no config to give now: Ray Tune asks again later
                return None
            key = config_key(self.search_space.resolve(config))
            if key not in self.suggested:
                self.suggested.add(key)
                return config
            fail_optuna_proposal(self, trial_id)
        untried = self.search_space.untried(self.suggested)
        if untried is None:
            return Searcher.FINISHED
        enqueue_optuna_config(self, untried)
        config = super().suggest(trial_id)
        if config is None:
            return None
        self.suggested.add(config_key(self.search_space.resolve(config)))
        return config
