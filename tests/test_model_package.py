"""The refit as an MLflow Model directory: models with layers of the researcher's own load and
predict in a process that never imported their experiments, each with its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pipeline.base.environment import installed_version
from pipeline.records.model_package import CODE_DIRECTORY, REQUIREMENTS, write_model_package

pytestmark = pytest.mark.training

NEIGHBOUR = textwrap.dedent(
    """
    import keras


    class Shift(keras.layers.Layer):  # imported by the experiment from beside it
        def call(self, x):
            return x + 1.0
    """
)

EXPERIMENT = textwrap.dedent(
    """
    import keras
    from my_layers import Shift


    class Halve(keras.layers.Layer):  # not registered with Keras: only this module knows it
        def call(self, x):
            return x * {factor}


    def soft_relu(x):  # an activation of its own, known by name
        return keras.ops.log1p(keras.ops.exp(x))


    def relu(x):  # a name of Keras' own: the model's "relu" stays Keras' relu
        return x * 0.0


    def build(hp):
        model = keras.Sequential(
            [
                keras.layers.Conv1D(4, 3, activation=soft_relu),
                Halve(),
                Shift(),
                keras.layers.Dense(4, activation="relu"),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model
    """
)


def packaged(directory: Path, factor: float, x: np.ndarray) -> tuple[Path, np.ndarray]:
    """A model of the experiment with ``Halve`` multiplying by ``factor``, packaged; and its predictions."""
    import keras_tuner

    from pipeline.inputs.hypermodel import load_builder

    directory.mkdir()
    (directory / "my_layers.py").write_text(NEIGHBOUR)
    experiment = directory / "my_experiment.py"
    experiment.write_text(EXPERIMENT.format(factor=factor))
    model = load_builder(experiment, "build")(keras_tuner.HyperParameters())
    expected = model.predict(x, verbose=0)
    package = write_model_package(model, directory / "model", x_train=x, experiment_path=experiment)
    assert sorted(path.name for path in (package / CODE_DIRECTORY).glob("my_*.py")) == [
        "my_experiment.py",
        "my_layers.py",
    ]
    return package, expected


def test_models_with_custom_layers_load_and_predict_in_a_fresh_process_each_with_its_own(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "my_layers", raising=False)
    x = np.random.default_rng(0).random((6, 20, 1), dtype=np.float32)
    halved, halved_expected = packaged(tmp_path / "halved", 0.5, x)
    monkeypatch.delitem(sys.modules, "my_layers")  # the second experiment imports its own
    quartered, quartered_expected = packaged(tmp_path / "quartered", 0.25, x)
    assert not np.allclose(halved_expected, quartered_expected)

    requirements = (halved / "requirements.txt").read_text().split()
    assert {f"{name}=={installed_version(name)}" for name in REQUIREMENTS} <= set(requirements)
    np.save(tmp_path / "x.npy", x)
    load = textwrap.dedent(
        f"""
        import numpy as np, mlflow.pyfunc, keras
        x = np.load({str(tmp_path / "x.npy")!r})
        for name in ("halved", "quartered"):
            model = mlflow.pyfunc.load_model({str(tmp_path)!r} + "/" + name + "/model")
            np.save({str(tmp_path)!r} + "/" + name + ".npy", model.predict(x))
        print(sorted(keras.saving.get_custom_objects()))
        """
    )
    loaded = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, cwd="/", timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "halved.npy"), halved_expected)
    np.testing.assert_array_equal(np.load(tmp_path / "quartered.npy"), quartered_expected)
    assert loaded.stdout.strip().splitlines()[-1] == "[]", "nothing is left registered with Keras"
