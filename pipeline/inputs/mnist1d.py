"""MNIST-1D made as the ``mnist1d`` package's ``make_dataset`` makes it, bit for bit, without
what makes the package slow to use here: importing it loads matplotlib and SciPy's
interpolation, and it builds one ``scipy.interpolate.interp1d`` per sample.

The random draws come from the same generator in the same order, sample by sample; each
interpolation is the ``np.interp`` call that ``interp1d`` hands a 1-D linear interpolation to,
and the arithmetic between them runs on all samples at once with the same operations, so every
float comes out the same (``tests/test_datasets.py`` compares the two array for array).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# The package's dataset arguments that are not options of the built-in (get_dataset_args()).
TEMPLATE_LEN = 12
PADDING = (36, 60)
SCALE_COEFF = 0.4
MAX_TRANSLATION = 48
CORR_NOISE_SCALE = 0.25
IID_NOISE_SCALE = 2e-2
SHEAR_SCALE = 0.75
FINAL_SEQ_LENGTH = 40
EPS = 1e-8  # transform()'s default, added to the template before padding

# get_templates()'s digit outlines, before whitening.
_OUTLINES = (
    (5, 6, 6.5, 6.75, 7, 7, 7, 7, 6.75, 6.5, 6, 5),
    (5, 3, 3, 3.4, 3.8, 4.2, 4.6, 5, 5.4, 5.8, 5, 5),
    (5, 6, 6.5, 6.5, 6, 5.25, 4.75, 4, 3.5, 3.5, 4, 5),
    (5, 6, 6.5, 6.5, 6, 5, 5, 6, 6.5, 6.5, 6, 5),
    (5, 4.4, 3.8, 3.2, 2.6, 2.6, 5, 5, 5, 5, 5, 5),
    (5, 3, 3, 3, 3, 5, 6, 6.5, 6.5, 6, 4.5, 5),
    (5, 4, 3.5, 3.25, 3, 3, 3, 3, 3.25, 3.5, 4, 5),
    (5, 7, 7, 6.6, 6.2, 5.8, 5.4, 5, 4.6, 4.2, 5, 5),
    (5, 4, 3.5, 3.5, 4, 5, 5, 4, 3.5, 3.5, 4, 5),
    (5, 4, 3.5, 3.5, 4, 5, 5, 5, 5, 4.7, 4.3, 5),
)


def templates() -> np.ndarray:
    """The ten digit templates, whitened and starting at 0, as ``get_templates()['x']``."""
    x = np.asarray(_OUTLINES, dtype=np.float64)
    x -= x.mean(1, keepdims=True)
    x /= x.std(1, keepdims=True)
    x -= x[:, :1]
    return x / 6.0


def make_dataset(num_samples: int, seed: int, train_split: float) -> dict[str, Any]:
    """``x``/``y`` and ``x_test``/``y_test`` (float64 signals of 40 steps, integer labels), as
    ``mnist1d.data.make_dataset`` makes them from the same arguments. NumPy's global generator is
    left alone: the draws come from a ``RandomState`` seeded as ``np.random.seed`` seeds it."""
    random = np.random.RandomState(seed)
    outlines = templates()
    per_class = num_samples // len(outlines)
    labels = np.repeat(np.arange(len(outlines)), per_class)
    dilated_len = TEMPLATE_LEN + PADDING[-1]
    dilated_grid = np.linspace(0, 1, dilated_len)
    padded_grids = {n: np.linspace(0, 1, n) for n in range(TEMPLATE_LEN + PADDING[0], dilated_len + 1)}

    dilated = np.empty((len(labels), dilated_len))
    scales = np.empty(len(labels))
    shifts = np.empty(len(labels), dtype=np.int64)
    corr_noise = np.empty((len(labels), dilated_len))
    iid_noise = np.empty((len(labels), dilated_len))
    shears = np.empty(len(labels))
    low, high = PADDING
    for i, label in enumerate(labels):  # the draws, in transform()'s order
        padding = low + int(random.rand() * (high - low + 1))
        padded = np.concatenate([outlines[label] + EPS, np.zeros(padding)])
        dilated[i] = np.interp(dilated_grid, padded_grids[len(padded)], padded)
        scales[i] = 1 + SCALE_COEFF * (random.rand() - 0.5)
        shifts[i] = random.choice(MAX_TRANSLATION)
        corr_noise[i] = CORR_NOISE_SCALE * random.randn(dilated_len)
        iid_noise[i] = IID_NOISE_SCALE * random.randn(dilated_len)
        shears[i] = SHEAR_SCALE * (random.rand() - 0.5)

    from scipy.ndimage import gaussian_filter1d

    dilated *= scales[:, None]
    # translate(): the last k steps moved to the front
    columns = (np.arange(dilated_len)[None, :] - shifts[:, None]) % dilated_len
    x = np.take_along_axis(dilated, columns, axis=1)
    mask = x != 0
    x = mask * x + (1 - mask) * gaussian_filter1d(corr_noise, 2, axis=-1)
    x = x + iid_noise
    x = x - shears[:, None] * np.linspace(-0.5, 0.5, dilated_len)
    final_grid = np.linspace(0, 1, FINAL_SEQ_LENGTH)
    xs = np.stack([np.interp(final_grid, dilated_grid, row) for row in x])

    shuffle = random.permutation(len(labels))
    xs = xs[shuffle]
    ys = labels[shuffle]
    xs = (xs - xs.mean()) / xs.std()
    split = int(len(ys) * train_split)
    return {"x": xs[:split], "x_test": xs[split:], "y": ys[:split], "y_test": ys[split:]}
