"""What the benchmarks share: the workloads, and the naive workflow foldsweep replaces."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import keras

from pipeline.inputs.datasets import Dataset, load_dataset
from pipeline.inputs.spec import DatasetSpec


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def mnist1d() -> Dataset:
    return load_dataset(DatasetSpec(name="mnist1d"))


def protein_windows(n_proteins: int) -> Dataset:
    """The built-in protein-window dataset (15 x 21 one-hot windows, 3 classes), sized by the
    number of proteins: ~190 gives ~36K CV training windows, ~48 about 9K."""
    data = load_dataset(DatasetSpec(name="protein_windows", options={"n_proteins": n_proteins}))
    return Dataset(name=f"protein{len(data.y) // 1000}k", x=data.x, y=data.y)


def cnn_builder(input_shape: tuple[int, ...], n_classes: int, dropout: float = 0.0):
    """The 3-conv 1D CNN of the design notes (no Dropout, BatchNormalization or regularizer), as a
    build(hp) function; optionally with Dropout before the head."""

    def build(hp: Any) -> keras.Model:
        inputs = keras.Input(shape=input_shape)
        x = inputs
        for filters in (32, 32, 32):
            x = keras.layers.Conv1D(filters, 3, padding="same", activation="relu")(x)
        x = keras.layers.GlobalMaxPooling1D()(x)
        if dropout:
            x = keras.layers.Dropout(dropout)(x)
        x = keras.layers.Dense(64, activation="relu")(x)
        outputs = keras.layers.Dense(n_classes, activation="softmax")(x)
        return keras.Model(inputs, outputs)

    return build


def fcn_builder(input_shape: tuple[int, ...], n_classes: int):
    """keras.io's fully convolutional network of "Timeseries classification from scratch": three
    Conv1D + BatchNormalization + ReLU blocks, global average pooling, a softmax head."""

    def build(hp: Any) -> keras.Model:
        inputs = keras.Input(shape=input_shape)
        x = inputs
        for _ in range(3):
            x = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(x)
            x = keras.layers.BatchNormalization()(x)
            x = keras.layers.ReLU()(x)
        x = keras.layers.GlobalAveragePooling1D()(x)
        outputs = keras.layers.Dense(n_classes, activation="softmax")(x)
        return keras.Model(inputs, outputs)

    return build


class EpochTimes(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._started = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.seconds.append(time.perf_counter() - self._started)


def naive_fold_fit(
    make_model: Callable[[], keras.Model],
    x_train,
    y_train,
    x_val,
    y_val,
    *,
    batch_size: int,
    epochs: int,
    learning_rate: float = 1e-3,
    seed: int = 0,
) -> tuple[list[float], float]:
    """The researcher's loop body today: a fresh model, default compile, `fit` on NumPy arrays.
    Returns the per-epoch training seconds and the final validation accuracy."""
    keras.utils.set_random_seed(seed)
    model = make_model()
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate), loss="sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    times = EpochTimes()
    model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=[times])
    accuracy = model.evaluate(x_val, y_val, batch_size=1024, verbose=0, return_dict=True)["accuracy"]
    keras.backend.clear_session()
    return times.seconds, float(accuracy)
