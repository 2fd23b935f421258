"""A 1D CNN regressing a continuous property of a protein window (15 residues x 21 one-hot
channels): the share of its residues in a helix. Compiled with mean squared error, and the mean
absolute error and RMSE as metrics (the sweep ranks by MAE, lower is better)."""

import keras
from keras import layers

WIDTH = 15
CHANNELS = 21


def build(hp):
    filters = hp.Int("filters", 16, 64, step=16, default=32)
    kernel_size = hp.Choice("kernel_size", [3, 5], default=5)
    inputs = keras.Input(shape=(WIDTH, CHANNELS))
    x = layers.Conv1D(filters, kernel_size, padding="same", activation="relu")(inputs)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dense(32, activation="relu")(x)
    outputs = layers.Dense(1)(x)
    model = keras.Model(inputs, outputs, name="protein_helix_fraction")
    model.compile(optimizer="adam", loss="mse", metrics=["mae", keras.metrics.RootMeanSquaredError(name="rmse")])
    return model
