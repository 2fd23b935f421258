"""A small 2D CNN for scikit-learn's 8x8 digits, as a KerasTuner hypermodel."""

import keras
from keras import layers


def build(hp):
    filters = hp.Int("filters", 16, 64, step=16, default=32)
    dense_units = hp.Choice("dense_units", [32, 64, 128], default=64)
    dropout = hp.Float("dropout", 0.0, 0.5, step=0.1, default=0.2)

    inputs = keras.Input(shape=(8, 8, 1))
    x = layers.Conv2D(filters, 3, padding="same", activation="relu")(inputs)
    x = layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D(2)(x)
    x = layers.Flatten()(x)
    x = layers.Dropout(dropout)(x)
    x = layers.Dense(dense_units, activation="relu")(x)
    outputs = layers.Dense(10, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="digits_cnn")
