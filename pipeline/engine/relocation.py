"""A sweep resumed from another directory than the one it was recorded in (an unpacked archive, a
project moved or copied to another machine) makes its trials where it is now.

Ray Tune's restore moves the trials it had already made to the experiment's new directory, but
the search algorithm's saved state keeps the experiment spec as the interrupted driver pickled
it, old storage path included, and every trial it makes after the resume is set to write there:
Ray fails such a trial at its first checkpoint when that path is gone ("Unable to set up cluster
storage") and, worse, writes into it when it still exists.

Imports Ray: ``pipeline.sweep`` imports this module only on a resume.
"""

from __future__ import annotations

from ray.tune.search import BasicVariantGenerator, ConcurrencyLimiter, SearchAlgorithm, Searcher, SearchGenerator

from pipeline.base.ray_private import move_storages


class MovableVariantGenerator(BasicVariantGenerator):
    """Grid and random search whose restored state makes its trials in ``experiment_path``."""

    experiment_path: str | None = None

    def set_state(self, state: dict) -> None:
        experiment_path = self.experiment_path  # the saved state carries the interrupted run's
        super().set_state(state)
        self.experiment_path = experiment_path
        if experiment_path is not None:
            move_storages(vars(self), experiment_path)


class MovableSearchGenerator(SearchGenerator):
    """A Searcher's trial maker (Optuna) whose restored state makes its trials in ``experiment_path``."""

    experiment_path: str | None = None

    def set_state(self, state: dict) -> None:
        super().set_state(state)
        if self.experiment_path is not None:
            move_storages(state, self.experiment_path)


def movable(
    search_alg: SearchAlgorithm | Searcher | None, experiment_path: str, max_concurrent: int | None
) -> SearchAlgorithm:
    """The restored Tuner's search algorithm, as one that makes its trials in ``experiment_path``.

    A Searcher is wrapped as Ray Tune's run would wrap it (in a ConcurrencyLimiter of
    ``max_concurrent``, then a SearchGenerator), so the Tuner must then pass no
    ``max_concurrent_trials`` of its own."""
    if isinstance(search_alg, Searcher):
        limited = ConcurrencyLimiter(search_alg, max_concurrent=max_concurrent) if max_concurrent else search_alg
        generator: MovableSearchGenerator | MovableVariantGenerator = MovableSearchGenerator(limited)
    elif isinstance(search_alg, BasicVariantGenerator):
        generator = MovableVariantGenerator()
        vars(generator).update(vars(search_alg))
    else:
        raise TypeError(f"cannot resume a sweep searched by a {type(search_alg).__name__}")
    generator.experiment_path = experiment_path
    return generator
