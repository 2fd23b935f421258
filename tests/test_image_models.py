"""The image models the benchmarks time (benchmarks/image_models.py) build as their docstring says."""

from __future__ import annotations

import keras_tuner
import pytest

from benchmarks import image_models


@pytest.mark.parametrize("name", image_models.NAMES)
def test_each_image_model_builds_a_ten_class_classifier_of_the_shapes(name):
    model = getattr(image_models, name)(keras_tuner.HyperParameters())
    assert model.input_shape == (None, 32, 32, 3) and model.output_shape == (None, 10)
    assert model.count_params() > 0
