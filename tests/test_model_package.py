"""The refit as an MLflow Model directory: a model with a layer of the researcher's own loads and
predicts in a process that never imported the experiment."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pipeline.base.environment import installed_version
from pipeline.records.model_package import CODE_DIRECTORY, REQUIREMENTS, write_model_package

pytestmark = pytest.mark.training

CUSTOM_LAYER_EXPERIMENT = textwrap.dedent(
    """
    import keras


    class Halve(keras.layers.Layer):  # not registered with Keras: only this module knows it
        def call(self, x):
            return x * 0.5


    def soft_relu(x):  # an activation of its own, known by name
        return keras.ops.log1p(keras.ops.exp(x))


    def build(hp):
        model = keras.Sequential(
            [
                keras.layers.Conv1D(4, 3, activation=soft_relu),
                Halve(),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model
    """
)


def test_a_model_with_a_custom_layer_loads_and_predicts_in_a_fresh_process(tmp_path):
    import keras_tuner

    from pipeline.inputs.hypermodel import load_builder

    experiment = tmp_path / "my_experiment.py"
    experiment.write_text(CUSTOM_LAYER_EXPERIMENT)
    model = load_builder(experiment, "build")(keras_tuner.HyperParameters())
    x = np.random.default_rng(0).random((6, 20, 1), dtype=np.float32)
    expected = model.predict(x, verbose=0)
    package = write_model_package(model, tmp_path / "model", x_train=x, experiment_path=experiment)

    assert (package / CODE_DIRECTORY / "my_experiment.py").read_text() == CUSTOM_LAYER_EXPERIMENT
    requirements = (package / "requirements.txt").read_text().split()
    assert {f"{name}=={installed_version(name)}" for name in REQUIREMENTS} <= set(requirements)
    np.save(tmp_path / "x.npy", x)
    load = (
        "import sys, numpy as np, mlflow.pyfunc; "
        f"model = mlflow.pyfunc.load_model({str(package)!r}); "
        f"np.save({str(tmp_path / 'predicted.npy')!r}, model.predict(np.load({str(tmp_path / 'x.npy')!r}))); "
        "print(sorted(name for name in sys.modules if name.startswith('my_') or name.endswith('my_experiment')))"
    )
    loaded = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, cwd="/", timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split("\n")[-2] == "['foldsweep_experiment_my_experiment']"
    np.testing.assert_array_equal(np.load(tmp_path / "predicted.npy"), expected)
