"""Is the best config really better than the next ones? The corrected resampled t-test.

Two configs scored on the same CV replicas give paired differences. A plain paired t-test on
them is far too confident: the replicas' training sets overlap, so their scores are correlated.
Nadeau & Bengio (2003, "Inference for the Generalization Error", Machine Learning 52) correct
the variance of the mean difference from ``1/J`` to ``1/J + n_val/n_train``; scikit-learn's
example "Statistical comparison of models using grid search" applies the same test to
``cv_results_``. Over k folds (repeated or not) each sample is validated once per repeat, so the
mean validation and training sizes are N/k and N - N/k, and ``n_val/n_train = 1/(k - 1)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SIGNIFICANCE_LEVEL = 0.05


@dataclass(frozen=True)
class Comparison:
    """One config against the best on the same replicas: the corrected t statistic and the
    one-sided p-value of "the best is better"."""

    t: float
    pvalue: float

    @property
    def tied(self) -> bool:
        """Statistically indistinguishable from the best (p >= 0.05)."""
        return self.pvalue >= SIGNIFICANCE_LEVEL


def val_train_ratio(n_splits: int) -> float:
    """``n_val / n_train`` of k-fold CV: each fold validates N/k samples and trains on the rest."""
    return 1.0 / (n_splits - 1)


def corrected_ttest(differences: Sequence[float], *, val_train_ratio: float) -> Comparison:
    """The corrected resampled t-test of paired per-replica differences (best minus other, signed
    so that positive means the best is better), one-sided.

    The t statistic is ``mean(d) / sqrt((1/J + n_val/n_train) * var(d))`` with the unbiased
    variance, on J - 1 degrees of freedom. Differences that are all equal have no variance: equal
    to zero (the same scores, e.g. the best against itself) gives p = 1, and a constant advantage
    gives p = 0.
    """
    # Student's t survival function as scipy.stats.t.sf computes it (its ``_sf``), without loading
    # scipy.stats: 0.6 s at a sweep's end, where Keras has loaded scipy.special, and more in a report.
    from scipy.special import stdtr

    values = np.asarray(differences, dtype=np.float64)
    replicas = len(values)
    if replicas < 2 or not np.all(np.isfinite(values)):
        raise ValueError(f"the corrected t-test needs >= 2 finite differences, got {values.tolist()}")
    mean = float(values.mean())
    if np.ptp(values) == 0.0:  # exactly equal (a float variance of equal values need not be 0)
        return Comparison(t=math.copysign(math.inf, mean) if mean else 0.0, pvalue=0.0 if mean > 0 else 1.0)
    variance = float(values.var(ddof=1)) * (1.0 / replicas + val_train_ratio)
    t = mean / math.sqrt(variance)
    return Comparison(t=t, pvalue=float(stdtr(replicas - 1, -t)))
