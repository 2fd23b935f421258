"""The refit as an MLflow Model directory (Keras flavor), ready to be logged: what
``mlflow.keras.log_model`` writes, with the pieces a researcher's model needs to load anywhere.

- A signature from the training data: the samples' shape with a batch dimension of -1, their dtype.
- An input example: the first training sample.
- As requirements, the versions installed here (the lock's, in a checkout), so that no
  subprocess is spent inferring them.
- The experiment module, saved under ``code/`` with a loader that imports it before Keras loads
  the model, so that the layers and functions it defines are known to Keras: a model with a
  custom layer loads in a process that never saw the sweep (``mlflow.pyfunc.load_model``,
  ``mlflow models serve``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.base.environment import installed_version

# What the model needs to load: Keras on TensorFlow, MLflow's flavor, and what experiment
# modules import (KerasTuner's HyperParameters).
REQUIREMENTS = ("mlflow", "keras", "tensorflow", "keras-tuner", "numpy")
EXAMPLE_SAMPLES = 1  # an image of 224x224x3 is some 3 MB of JSON, twice over (input and serving examples)
CODE_DIRECTORY = "code"
LOADER_MODULE = "foldsweep_model_loader"
# The name the experiment module is imported under, in the sweep and by the loader, so that the
# classes it defines are the ones the saved model names.
EXPERIMENT_MODULE_PREFIX = "foldsweep_experiment_"

_LOADER_SOURCE = f'''"""Loads a foldsweep refit: imports the experiment module saved beside this file, so that the
layers, losses and functions it defines are known to Keras, then loads the model as MLflow's Keras
flavor does."""

import importlib.util
import inspect
import pathlib
import sys

import keras
import mlflow.keras


def _register(path):
    name = "{EXPERIMENT_MODULE_PREFIX}" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    known = keras.saving.get_custom_objects()
    for attr, value in vars(module).items():
        if (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__ == name:
            known.setdefault(attr, value)


def _load_pyfunc(path):
    for source in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        if source.stem != "{LOADER_MODULE}":
            _register(source)
    return mlflow.keras._load_pyfunc(path)
'''


def requirements() -> list[str]:
    """``name==version`` of each of ``REQUIREMENTS`` installed here."""
    pinned = ((name, installed_version(name)) for name in REQUIREMENTS)
    return [f"{name}=={version}" for name, version in pinned if version is not None]


def write_model_package(model: Any, directory: Path, *, x_train: np.ndarray, experiment_path: Path) -> Path:
    """Save ``model`` as an MLflow Model (Keras flavor) in ``directory`` (a new one), with a
    signature and an input example from ``x_train`` and the experiment module; returns
    ``directory``."""
    import mlflow.keras
    from mlflow import pyfunc
    from mlflow.models import Model, ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    directory.mkdir(parents=True)
    example = np.ascontiguousarray(x_train[:EXAMPLE_SAMPLES])
    signature = ModelSignature(inputs=Schema([TensorSpec(x_train.dtype, (-1, *x_train.shape[1:]))]))
    mlflow.keras.save_model(
        model,
        str(directory),
        signature=signature,
        input_example=example,
        pip_requirements=requirements(),
    )
    code = directory / CODE_DIRECTORY
    code.mkdir()
    shutil.copy2(experiment_path, code / experiment_path.name)
    (code / f"{LOADER_MODULE}.py").write_text(_LOADER_SOURCE, encoding="utf-8")
    described = Model.load(str(directory))
    described.flavors[pyfunc.FLAVOR_NAME].update({pyfunc.MAIN: LOADER_MODULE, pyfunc.CODE: CODE_DIRECTORY})
    described.save(str(directory / "MLmodel"))
    return directory
