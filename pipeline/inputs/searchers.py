"""Ray Tune's searchers, made never to suggest a config twice: random and grid search draw from the
``SearchSpace``; Optuna TPE is asked again when it proposes a config it proposed before.

Imports Ray Tune's search modules (``pipeline.sweep`` imports this one when it builds a Tuner).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ray.tune.search import Searcher
from ray.tune.search.basic_variant import BasicVariantGenerator
from ray.tune.search.optuna import OptunaSearch

from pipeline.base.ray_private import add_drawn_trials
from pipeline.inputs.space import SearchSpace, config_key

logger = logging.getLogger(__name__)

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
    ``SearchSpace.trial_count`` trials, as random search does.

    Each proposal is asked for under an id of its own (OptunaSearch keeps one Optuna trial per
    id), the trial's id for the first: a trial whose config came from a later proposal reports
    its results and its end under that proposal's id (``proposal_of``). All of it is
    OptunaSearch's and Optuna's public interface, saved and restored with the searcher; one
    restored from state that lacks them (``proposing``, ``proposal_of``) ends its search where it
    would have enqueued a config."""

    def __init__(self, space: SearchSpace, **kwargs: Any):
        self.proposing = ProposingSpace(space.optuna_define_by_run())
        super().__init__(space=self.proposing, **kwargs)
        self.search_space = space
        self.suggested: set[str] = set()  # the keys of the configs suggested
        self.proposal_of: dict[str, str] = {}  # a trial's id -> the id its config was proposed under

    # Ray annotates suggest as returning a dict or None, but documents (and takes) Searcher.FINISHED.
    def suggest(self, trial_id: str) -> dict | str | None:  # type: ignore[override]
        for attempt in range(REPEATS_BEFORE_A_NEW_CONFIG):
            proposal = self._proposal(trial_id, attempt)
            config = super().suggest(proposal)
            if config is None:  # Optuna has no config to give now: Ray Tune asks again later
                return None
            key = config_key(self.search_space.resolve(config))
            if key not in self.suggested:
                return self._suggested(trial_id, proposal, key, config)
            super().on_trial_complete(proposal, error=True)  # FAILED: TPE learns nothing of it
        untried = self.search_space.untried(self.suggested)
        if untried is None:
            return Searcher.FINISHED
        if "proposing" not in vars(self):  # restored from a state that does not keep the study
            logger.warning("Optuna keeps proposing configs it proposed before; the search ends here")
            return Searcher.FINISHED
        self.proposing.study.enqueue_trial(untried)
        proposal = self._proposal(trial_id, REPEATS_BEFORE_A_NEW_CONFIG)
        config = super().suggest(proposal)
        if config is None:
            return None
        return self._suggested(trial_id, proposal, config_key(self.search_space.resolve(config)), config)

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        super().on_trial_result(self._proposed_as(trial_id), result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        super().on_trial_complete(self._proposed_as(trial_id), result, error)

    @staticmethod
    def _proposal(trial_id: str, attempt: int) -> str:
        return trial_id if attempt == 0 else f"{trial_id}:proposal{attempt}"

    def _suggested(self, trial_id: str, proposal: str, key: str, config: dict) -> dict:
        self.suggested.add(key)
        if proposal != trial_id:
            vars(self).setdefault("proposal_of", {})[trial_id] = proposal
        return config

    def _proposed_as(self, trial_id: str) -> str:
        """The id ``trial_id``'s config was proposed under (its own unless Optuna repeated itself)."""
        return vars(self).get("proposal_of", {}).get(trial_id, trial_id)


class ProposingSpace:
    """An Optuna define-by-run space that keeps the study of the last trial it answered
    (``optuna.Trial.study``), for a config to be enqueued there."""

    def __init__(self, space: Callable[[Any], dict[str, Any]]):
        self.space = space
        self.study: Any = None

    def __call__(self, trial: Any) -> dict[str, Any]:
        self.study = trial.study
        return self.space(trial)
