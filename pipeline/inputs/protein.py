"""Synthetic protein windows: the scenario foldsweep was born from, generated locally.

Proteins are chains of secondary-structure segments (helix, strand, coil). Each residue is drawn
with probability proportional to its background frequency times its Chou-Fasman conformational
parameter for the segment's state, so that residue composition carries (noisy) information about
structure, as in real proteins. Every residue then becomes a sample: a window of ``width``
residues centred on it, one-hot over the 20 amino acids plus a padding symbol beyond the chain
ends, labelled with the centre residue's state. ``groups`` is the protein id, so grouped CV keeps
all windows of a protein on one side of a fold.

``target`` chooses what a window is labelled with: ``centre`` (the centre residue's state, one
class per window), ``per_residue`` (the state of every residue of the window, ``(width,)``
integer labels, -1 where the window reaches beyond the chain: padding for a loss with
``ignore_class=-1``), or ``helix_fraction`` (a continuous per-window property for regression: the
share of the window's residues in a helix, padding left out).

Conformational parameters from Chou, P. Y. & Fasman, G. D. (1978). Prediction of the secondary
structure of proteins from their amino acid sequence. Advances in Enzymology and Related Areas of
Molecular Biology 47, 45-148 (Table of P(alpha), P(beta), P(turn); turn values stand in for coil).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pipeline.base.errors import DataError

AMINO_ACIDS = "ARNDCQEGHILKMFPSTWYV"
PADDING = len(AMINO_ACIDS)  # index of the padding symbol, the 21st channel
STATES = ("helix", "strand", "coil")

# Chou & Fasman (1978): P(alpha), P(beta), P(turn), x100, in the order of AMINO_ACIDS.
CHOU_FASMAN = (
    np.array(
        [
            # P(a)  P(b)  P(t)
            [142, 83, 66],  # A Ala
            [98, 93, 95],  # R Arg
            [67, 89, 156],  # N Asn
            [101, 54, 146],  # D Asp
            [70, 119, 119],  # C Cys
            [111, 110, 98],  # Q Gln
            [151, 37, 74],  # E Glu
            [57, 75, 156],  # G Gly
            [100, 87, 95],  # H His
            [108, 160, 47],  # I Ile
            [121, 130, 59],  # L Leu
            [114, 74, 101],  # K Lys
            [145, 105, 60],  # M Met
            [113, 138, 60],  # F Phe
            [57, 55, 152],  # P Pro
            [77, 75, 143],  # S Ser
            [83, 119, 96],  # T Thr
            [108, 137, 96],  # W Trp
            [69, 147, 114],  # Y Tyr
            [106, 170, 50],  # V Val
        ],
        dtype=np.float64,
    )
    / 100.0
)

# How segments are drawn: the share of segments of each state, and their length range
# (inclusive), typical of globular proteins.
SEGMENT_SHARES = np.array([0.35, 0.25, 0.40])
SEGMENT_LENGTHS = ((6, 18), (4, 10), (3, 12))

DEFAULTS: Mapping[str, Any] = {
    "n_proteins": 390,  # ~75K CV training windows (312 proteins) + ~19K held out (78)
    "test_fraction": 0.2,  # share of proteins held out as the test split
    "width": 15,  # residues per window (odd: the labelled residue sits in the middle)
    "min_length": 80,
    "max_length": 400,
    "seed": 0,
    "target": "centre",  # centre | per_residue | helix_fraction (see the module's docstring)
}
TARGETS = ("centre", "per_residue", "helix_fraction")


def residue_probabilities() -> np.ndarray:
    """P(residue | state), shape (3, 20): background frequency x conformational parameter."""
    background = np.full(len(AMINO_ACIDS), 1.0 / len(AMINO_ACIDS))
    weights = CHOU_FASMAN.T * background
    return weights / weights.sum(axis=1, keepdims=True)


def validate(options: Mapping[str, Any]) -> None:
    def integer(key: str, minimum: int) -> int:
        value = options[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise DataError(f"dataset.{key} must be an integer >= {minimum}, got {value!r}")
        return value

    integer("n_proteins", 4)
    integer("seed", 0)
    width = integer("width", 1)
    if width % 2 == 0:
        raise DataError(f"dataset.width must be odd (the labelled residue sits in the middle), got {width}")
    low, high = integer("min_length", width), integer("max_length", 1)
    if high < low:
        raise DataError(f"dataset.max_length must be >= dataset.min_length ({low}), got {high}")
    if options["target"] not in TARGETS:
        raise DataError(f"dataset.target must be one of {', '.join(TARGETS)}, got {options['target']!r}")
    fraction = options["test_fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise DataError(f"dataset.test_fraction must be a number in [0, 1), got {fraction!r}")


def generate(options: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Windows of the CV training proteins (x, y, groups) and of held-out proteins (x_test, y_test)."""
    rng = np.random.default_rng(options["seed"])
    probabilities = residue_probabilities()
    sequences, states = [], []
    for _ in range(options["n_proteins"]):
        length = int(rng.integers(options["min_length"], options["max_length"] + 1))
        protein_states = _segment_states(rng, length)
        residues = np.empty(length, dtype=np.int64)
        for state in range(len(STATES)):
            where = protein_states == state
            residues[where] = rng.choice(len(AMINO_ACIDS), size=int(where.sum()), p=probabilities[state])
        sequences.append(residues)
        states.append(protein_states)
    n_test = int(round(options["n_proteins"] * options["test_fraction"]))
    train = range(options["n_proteins"] - n_test)
    test = range(options["n_proteins"] - n_test, options["n_proteins"])
    x, y, groups = _windows(sequences, states, train, options["width"], options["target"])
    arrays = {"x": x, "y": y, "groups": groups}
    if n_test:
        arrays["x_test"], arrays["y_test"], _ = _windows(sequences, states, test, options["width"], options["target"])
    return arrays


def _segment_states(rng: np.random.Generator, length: int) -> np.ndarray:
    states = np.empty(length, dtype=np.int32)
    position = 0
    while position < length:
        state = int(rng.choice(len(STATES), p=SEGMENT_SHARES))
        low, high = SEGMENT_LENGTHS[state]
        size = int(rng.integers(low, high + 1))
        states[position : position + size] = state
        position += size
    return states


def _windows(
    sequences: list[np.ndarray], states: list[np.ndarray], proteins: range, width: int, target: str = "centre"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    half = width // 2
    one_hot = np.eye(len(AMINO_ACIDS) + 1, dtype=np.float32)
    xs, ys, groups = [], [], []
    for protein in proteins:
        padded = np.concatenate([np.full(half, PADDING), sequences[protein], np.full(half, PADDING)])
        index = np.arange(len(sequences[protein]))[:, None] + np.arange(width)[None, :]
        xs.append(one_hot[padded[index]])
        window_states = np.concatenate([np.full(half, -1), states[protein], np.full(half, -1)])[index]
        if target == "per_residue":
            ys.append(window_states)
        elif target == "helix_fraction":
            inside = window_states >= 0
            ys.append(((window_states == 0) & inside).sum(axis=1) / inside.sum(axis=1))
        else:
            ys.append(states[protein])
        groups.append(np.full(len(sequences[protein]), protein, dtype=np.int32))
    y = np.concatenate(ys)
    return np.concatenate(xs), y.astype(np.float32 if target == "helix_fraction" else np.int32), np.concatenate(groups)
