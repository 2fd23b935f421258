"""A 1D CNN over protein windows (15 residues x 21 one-hot channels), predicting the centre
residue's secondary structure (helix/strand/coil), as a KerasTuner hypermodel."""

import keras
from keras import layers

WIDTH = 15
CHANNELS = 21  # 20 amino acids + padding
N_STATES = 3


def build(hp):
    depth = hp.Int("conv_layers", 1, 3, default=2)
    filters = hp.Int("filters", 32, 128, step=32, default=64)
    kernel_size = hp.Choice("kernel_size", [3, 5, 7], default=5)
    dropout = hp.Float("dropout", 0.0, 0.5, step=0.1, default=0.2)
    batch_norm = hp.Boolean("batch_norm", default=False)

    inputs = keras.Input(shape=(WIDTH, CHANNELS))
    x = inputs
    for _ in range(depth):
        x = layers.Conv1D(filters, kernel_size, padding="same", use_bias=not batch_norm)(x)
        if batch_norm:
            x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
    # The label belongs to the centre residue: keep position (flatten), do not pool it away.
    x = layers.Flatten()(x)
    x = layers.Dropout(dropout)(x)
    x = layers.Dense(64, activation="relu")(x)
    outputs = layers.Dense(N_STATES, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="protein_cnn")
