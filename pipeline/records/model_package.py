"""The refit as an MLflow Model directory (Keras flavor), ready to be logged: what
``mlflow.keras.log_model`` writes, with the pieces a researcher's model needs to load anywhere.

- A signature from the training data: the samples' shape with a batch dimension of -1, their dtype.
- An input example: the first training sample.
- As requirements, the versions installed here (the lock's, in a checkout), so that no
  subprocess is spent inferring them.
- The experiment module (and the modules beside it that it imported), saved under ``code/`` with
  a loader that imports it while Keras loads the model, so that the layers and functions it
  defines are known to Keras: a model with a custom layer loads in a process that never saw the
  sweep (``mlflow.pyfunc.load_model``, ``mlflow models serve``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.base.environment import installed_version
from pipeline.inputs.hypermodel import experiment_module_name
from pipeline.records.experiment_code import neighbour_modules

# What the model needs to load: Keras on TensorFlow, MLflow's flavor, and what experiment
# modules import (KerasTuner's HyperParameters).
REQUIREMENTS = ("mlflow", "keras", "tensorflow", "keras-tuner", "numpy")
EXAMPLE_SAMPLES = 1  # an image of 224x224x3 is some 3 MB of JSON, twice over (input and serving examples)
CODE_DIRECTORY = "code"
LOADER_MODULE = "foldsweep_model_loader"

_LOADER_SOURCE = '''"""Loads a foldsweep refit as an MLflow pyfunc model: imports the experiment module saved beside
this file, so that the layers and functions it defines are known to Keras while it loads the model
(and to nothing else: every load imports the module of its own model)."""

import importlib.util
import inspect
import pathlib
import sys
import warnings

import keras
import mlflow.keras
from mlflow.keras.load import KerasModelWrapper
from mlflow.models import Model

EXPERIMENT = {experiment!r}
MODULE = {module!r}
NEIGHBOURS = {neighbours!r}  # the modules beside it that it imports, saved with it
# What Keras names itself: a module's own function or class of the same name does not replace it.
KERAS_NAMES = set().union(
    *(dir(part) for part in (keras.layers, keras.activations, keras.losses, keras.metrics, keras.initializers,
                             keras.regularizers, keras.constraints, keras.optimizers))
)


def _custom_objects(code):
    spec = importlib.util.spec_from_file_location(MODULE, code / EXPERIMENT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        warnings.warn(f"importing the experiment module {{EXPERIMENT}} failed ({{exc!r}}): the model loads without it")
        return {{}}
    own = {{MODULE, *NEIGHBOURS}}
    namespaces = [module, *(sys.modules[name] for name in NEIGHBOURS if name in sys.modules)]
    return {{
        name: value
        for namespace in namespaces
        for name, value in vars(namespace).items()
        if (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ in own
        and name not in KERAS_NAMES
    }}


def _load_pyfunc(path):
    root = pathlib.Path(path)
    model = mlflow.keras.load_model(str(root), custom_objects=_custom_objects(root / "code"))
    return KerasModelWrapper(model, Model.load(str(root)).signature)
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
    neighbours = neighbour_modules(experiment_path)
    for source in [experiment_path, *neighbours]:
        shutil.copy2(source, code / source.name)
    loader = _LOADER_SOURCE.format(
        experiment=experiment_path.name,
        module=experiment_module_name(experiment_path),
        neighbours=[source.stem for source in neighbours],
    )
    (code / f"{LOADER_MODULE}.py").write_text(loader, encoding="utf-8")
    described = Model.load(str(directory))
    described.flavors[pyfunc.FLAVOR_NAME].update({pyfunc.MAIN: LOADER_MODULE, pyfunc.CODE: CODE_DIRECTORY})
    described.save(str(directory / "MLmodel"))
    return directory
