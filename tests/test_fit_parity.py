"""foldsweep trains what the researcher wrote: each honoured feature of a compiled Keras model,
trained through `foldsweep trial`, lands where Keras' own `model.fit` lands on the same folds, and
`fit` with the feature dropped lands far away (so that each case can fail).

Tolerance: `fit` is given exactly what foldsweep trains on: each fold model built under the
fold's seed, and each epoch the fold's batches in foldsweep's order (``epoch_order``), without
Keras' own shuffle. What is left between the two is float rounding (XLA in Keras' step, not in
foldsweep's here; another summation order), which can flip a prediction that sits on the
decision boundary: ``TOLERANCE`` = 0.01 is 6 of the 600 validation samples. Every dropped
feature moves the CV mean by at least ``FAR`` = 0.15: a foldsweep that ignored the feature would
land far outside the tolerance and fail.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from conftest import binary_data
from pipeline.cli import app

pytestmark = pytest.mark.training  # every test trains the same model with keras fit and with foldsweep

TOLERANCE = 0.01
FAR = 0.15
EPOCHS = 5
BATCH = 32

EXPERIMENT = '''
import keras
from keras import layers

def body(units, activation, regularizer=None, penalty=False):
    stack = [layers.Conv1D(8, 3, activation="relu", kernel_regularizer=regularizer), layers.Flatten(),
             layers.Dense(8, activation="relu", kernel_regularizer=regularizer)]
    if penalty:
        stack.append(Penalty())
    stack.append(layers.Dense(units, activation=activation, kernel_regularizer=regularizer))
    return keras.Sequential(stack)  # no Input: built on the data's shape, as Keras' fit would


class Penalty(layers.Layer):
    """An extra loss term through the layer API (add_loss), as keras.io's guide writes one."""

    def call(self, x):
        self.add_loss(50.0 * keras.ops.mean(keras.ops.abs(x)))
        return x


def compiled(model, optimizer, loss, metrics=("accuracy",)):
    model.compile(optimizer=optimizer, loss=loss, metrics=list(metrics))
    return model


def schedule(hp):
    rate = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=10, decay_rate=0.001)
    return compiled(body(1, "sigmoid"), keras.optimizers.Adam(rate), "binary_crossentropy")


def logits(hp):
    return compiled(body(2, None), keras.optimizers.Adam(0.01),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def logits_dropped(hp):
    return compiled(body(2, None), keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy())


def sigmoid(hp):
    return compiled(body(1, "sigmoid"), keras.optimizers.Adam(0.01), "binary_crossentropy")


def sigmoid_dropped(hp):  # one unit scored as classes (arg max) instead of by binary accuracy
    return compiled(body(1, "sigmoid"), keras.optimizers.Adam(0.01), "binary_crossentropy",
                    metrics=["sparse_categorical_accuracy"])


def regularizer(hp):
    return compiled(body(1, "sigmoid", keras.regularizers.l2(1.0)), keras.optimizers.Adam(0.01), "binary_crossentropy")


def add_loss(hp):
    return compiled(body(1, "sigmoid", penalty=True), keras.optimizers.Adam(0.01), "binary_crossentropy")


# Without their feature these are the plain sigmoid model: one name, so that its fit is made once.
schedule_dropped = regularizer_dropped = add_loss_dropped = sigmoid
'''

FEATURES = ("schedule", "logits", "sigmoid", "regularizer", "add_loss")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    directory = tmp_path_factory.mktemp("parity")
    x, y = binary_data()
    np.savez(directory / "binary.npz", x=x, y=y)
    (directory / "parity.py").write_text(EXPERIMENT)
    return directory


def spec_for(directory: Path, builder: str) -> Path:
    path = directory / f"{builder}.yaml"
    path.write_text(yaml.safe_dump({
        "name": f"parity-{builder}", "experiment": f"parity.py:{builder}", "dataset": "binary.npz",
        "cv": {"splitter": "stratified", "n_splits": 3, "seed": 0},
        "search": {"space": {"batch_size": BATCH}},
        # Compilation is not what is compared here; without XLA the cases run in seconds.
        # More epochs than are trained: `trial --epochs` says how many, in its header too.
        "train": {"epochs": EPOCHS + 4, "seed": 0, "jit_compile": False},
        "tracking": {"uri": f"sqlite:///{directory / 'mlflow.db'}"},
    }))
    return path


def foldsweep_cv_mean(spec: Path) -> float:
    """The last epoch's mean_val_accuracy that `foldsweep trial` prints (in this process, where
    the test's own `fit` started TensorFlow: ``threads_kept``)."""
    result = CliRunner().invoke(app, ["trial", str(spec), "--epochs", str(EPOCHS)])
    assert result.exit_code == 0, result.output
    assert re.search(rf"\bepochs={EPOCHS}\b", result.output.splitlines()[0]), result.output
    epochs = re.findall(r"^epoch (\d+):.*mean_val_accuracy (\S+)$", result.output, re.MULTILINE)
    assert [int(epoch) for epoch, _ in epochs] == list(range(1, EPOCHS + 1)), result.output
    return float(epochs[-1][1])


# Keras' fits by the name of the function that builds the model (aliases share one).
KERAS_FITS: dict[str, float] = {}


def keras_fit_cv_mean(spec: Path, builder: str) -> float:
    """Keras' own fit of ``builder`` on the sweep's folds, each fold model built as foldsweep
    builds it (same seed, same default hyperparameters) and fed foldsweep's batches."""
    from pipeline.inputs.hypermodel import load_builder

    build = load_builder(spec.parent / "parity.py", builder)
    if build.__name__ not in KERAS_FITS:
        KERAS_FITS[build.__name__] = _keras_fit_cv_mean(spec, build)
    return KERAS_FITS[build.__name__]


def _keras_fit_cv_mean(spec: Path, build) -> float:
    import keras

    from pipeline.inputs.hypermodel import build_model
    from pipeline.inputs.spec import load_spec
    from pipeline.sweep import prepare
    from pipeline.engine.training import epoch_order, fold_seed

    prepared = prepare(load_spec(spec))
    data = prepared.dataset
    scores = []
    for k, fold in enumerate(prepared.folds.folds):
        seed = fold_seed(prepared.spec.train.seed, k)
        keras.utils.set_random_seed(seed)
        model = build_model(build, {}, input_shape=data.input_shape)
        for epoch in range(EPOCHS):  # one fit call per epoch: the optimizer (and its schedule) goes on
            order = epoch_order(fold.train, seed=seed, epoch=epoch)
            history = model.fit(data.x[order], data.y[order], batch_size=BATCH, epochs=1, shuffle=False,
                                validation_data=(data.x[fold.val], data.y[fold.val]), verbose=0).history
        scores.append(history.get("val_accuracy", history.get("val_sparse_categorical_accuracy"))[-1])
    keras.backend.clear_session()
    return float(np.mean(scores))


@pytest.mark.parametrize("feature", FEATURES)
def test_an_honoured_feature_trains_as_keras_fit_does(workspace, feature, threads_kept):
    spec = spec_for(workspace, feature)
    ours = foldsweep_cv_mean(spec)
    keras_with = keras_fit_cv_mean(spec, feature)
    keras_without = keras_fit_cv_mean(spec, f"{feature}_dropped")
    assert abs(ours - keras_with) <= TOLERANCE, (feature, ours, keras_with, keras_without)
    assert abs(keras_without - keras_with) >= FAR, (feature, ours, keras_with, keras_without)
