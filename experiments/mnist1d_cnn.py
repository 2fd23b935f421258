"""A 1D CNN for MNIST-1D (40-step signals, 10 classes), written as a KerasTuner hypermodel.

foldsweep discovers the hyperparameters below by building once; a sweep spec can override any
of their ranges under `search.space`.
"""

import keras
from keras import layers

INPUT_SHAPE = (40, 1)
N_CLASSES = 10


def build(hp):
    depth = hp.Int("conv_layers", 1, 3, default=2)
    filters = hp.Int("filters", 16, 64, step=16, default=32)
    kernel_size = hp.Choice("kernel_size", [3, 5, 7], default=5)
    dropout = hp.Float("dropout", 0.0, 0.4, step=0.1, default=0.1)

    inputs = keras.Input(shape=INPUT_SHAPE)
    x = inputs
    for _ in range(depth):
        x = layers.Conv1D(filters, kernel_size, padding="same", activation="relu")(x)
        x = layers.MaxPooling1D(2)(x)
    x = layers.Flatten()(x)
    x = layers.Dropout(dropout)(x)
    x = layers.Dense(64, activation="relu")(x)
    outputs = layers.Dense(N_CLASSES, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="mnist1d_cnn")
