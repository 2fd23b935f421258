"""Hypermodels written the way KerasTuner's own guides write them, for the tests."""

import keras
import keras_tuner
from keras import layers


def sequential_no_input(hp):
    model = keras.Sequential()
    model.add(layers.Flatten())
    for i in range(hp.Int("num_layers", 1, 3)):
        model.add(layers.Dense(units=hp.Int(f"units_{i}", min_value=32, max_value=512, step=32), activation="relu"))
    if hp.Boolean("dropout"):
        model.add(layers.Dropout(rate=0.25))
    model.add(layers.Dense(10, activation="softmax"))
    learning_rate = hp.Float("lr", min_value=1e-4, max_value=1e-2, sampling="log")
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=learning_rate), loss="categorical_crossentropy",
                  metrics=["accuracy"])
    return model


class Subclassed(keras.Model):
    def __init__(self, units):
        super().__init__()
        self.flatten = layers.Flatten()
        self.hidden = layers.Dense(units, activation="relu")
        self.out = layers.Dense(10, activation="softmax")

    def call(self, x):
        return self.out(self.hidden(self.flatten(x)))


def subclassed(hp):
    return Subclassed(hp.Int("units", 16, 64, step=16))


class TunedFit(keras_tuner.HyperModel):
    def build(self, hp):
        model = keras.Sequential([layers.Flatten(), layers.Dense(hp.Int("units", 16, 64, step=16), activation="relu"),
                                  layers.Dense(10, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    def fit(self, hp, model, *args, **kwargs):
        return model.fit(*args, batch_size=hp.Choice("batch_size", [8, 16]), shuffle=hp.Boolean("shuffle"), **kwargs)


class Preprocessing(TunedFit):
    def fit(self, hp, model, x, y, **kwargs):
        return model.fit(x / 255.0, y, **kwargs)
