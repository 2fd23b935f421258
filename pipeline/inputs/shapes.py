"""Shapes: a built-in image dataset generated locally, for 2D CNNs with augmentation and
keras.applications backbones (32 x 32 RGB images, 10 classes, values 0-255 as Keras' image
loaders give them).

Each image is one shape, drawn at a random place, size and colour on a background of another
colour with pixel noise: a disk, a ring, a square, a square's outline, a triangle, a plus, a
cross, horizontal stripes, vertical stripes or a checkerboard. Telling them apart takes shape, not
colour; flips leave every class a member of itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pipeline.base.errors import DataError

CLASSES = (
    "disk",
    "ring",
    "square",
    "outline",
    "triangle",
    "plus",
    "cross",
    "horizontal_stripes",
    "vertical_stripes",
    "checkerboard",
)
DEFAULTS: Mapping[str, Any] = {"num_samples": 3000, "image_size": 32, "test_fraction": 0.2, "seed": 0}
NOISE = 0.08  # the pixels' noise, on colours in [0, 1]


def validate(options: Mapping[str, Any]) -> None:
    if not isinstance(options["num_samples"], int) or options["num_samples"] < 100:
        raise DataError(f"dataset.num_samples must be an integer >= 100, got {options['num_samples']!r}")
    if not isinstance(options["image_size"], int) or not 16 <= options["image_size"] <= 256:
        raise DataError(f"dataset.image_size must be an integer from 16 to 256, got {options['image_size']!r}")
    if not isinstance(options["test_fraction"], (int, float)) or not 0 < options["test_fraction"] < 1:
        raise DataError(f"dataset.test_fraction must be between 0 and 1, got {options['test_fraction']!r}")
    if not isinstance(options["seed"], int) or options["seed"] < 0:
        raise DataError(f"dataset.seed must be an integer >= 0, got {options['seed']!r}")


def generate(options: Mapping[str, Any]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(options["seed"])
    n, size = options["num_samples"], options["image_size"]
    labels = rng.integers(0, len(CLASSES), n)
    rows, cols = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    images = np.empty((n, size, size, 3), np.float32)
    for i, label in enumerate(labels):
        centre = rng.uniform(0.35, 0.65, 2) * size
        radius = rng.uniform(0.18, 0.3) * size
        mask = _shape(CLASSES[label], rows - centre[0], cols - centre[1], radius)
        foreground, background = rng.uniform(0.45, 1.0, 3), rng.uniform(0.0, 0.35, 3)
        image = np.where(mask[..., None], foreground, background) + rng.normal(0.0, NOISE, (size, size, 3))
        images[i] = np.clip(image, 0.0, 1.0) * 255.0
    test = int(round(n * options["test_fraction"]))
    return {"x": images[test:], "y": labels[test:], "x_test": images[:test], "y_test": labels[:test]}


def _shape(name: str, dy: np.ndarray, dx: np.ndarray, radius: float) -> np.ndarray:
    """The pixels of shape ``name`` of size ``radius``, from each pixel's offset to its centre."""
    distance = np.hypot(dy, dx)
    inside = np.maximum(np.abs(dy), np.abs(dx)) <= radius
    bar = radius / 3
    if name == "disk":
        return distance <= radius
    if name == "ring":
        return (distance <= radius) & (distance >= radius * 0.6)
    if name == "square":
        return inside
    if name == "outline":
        return inside & (np.maximum(np.abs(dy), np.abs(dx)) >= radius * 0.65)
    if name == "triangle":
        return (dy <= radius) & (dy >= 2 * np.abs(dx) - radius)
    if name == "plus":
        return inside & ((np.abs(dy) <= bar) | (np.abs(dx) <= bar))
    if name == "cross":
        return inside & (np.abs(np.abs(dy) - np.abs(dx)) <= bar)
    if name == "horizontal_stripes":
        return inside & (np.floor(dy / bar) % 2 == 0)
    if name == "vertical_stripes":
        return inside & (np.floor(dx / bar) % 2 == 0)
    return inside & ((np.floor(dy / bar) + np.floor(dx / bar)) % 2 == 0)  # checkerboard
