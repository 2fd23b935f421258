"""A 1D CNN labelling every residue of a protein window (15 residues x 21 one-hot channels) with
its secondary structure (helix/strand/coil): outputs [batch, 15, 3], trained with
SparseCategoricalCrossentropy(ignore_class=-1) so that positions beyond the chain (label -1) count
in no loss, and scored by Q3, the per-residue accuracy over the residues that exist, as a
researcher's own keras.metrics.Metric."""

import keras
from keras import layers

WIDTH = 15
CHANNELS = 21  # 20 amino acids + padding
N_STATES = 3


class Q3(keras.metrics.Metric):
    """Share of residues (padding left out) whose state is predicted right, over every batch seen."""

    def __init__(self, name="q3", **kwargs):
        super().__init__(name=name, **kwargs)
        self.right = self.add_variable((), initializer="zeros", name="right")
        self.residues = self.add_variable((), initializer="zeros", name="residues")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = keras.ops.cast(y_true, "int32")
        kept = keras.ops.cast(y_true >= 0, "float32")
        hit = keras.ops.cast(keras.ops.argmax(y_pred, axis=-1) == y_true, "float32") * kept
        self.right.assign_add(keras.ops.sum(hit))
        self.residues.assign_add(keras.ops.sum(kept))

    def result(self):
        return self.right / keras.ops.maximum(self.residues, 1.0)


def build(hp):
    depth = hp.Int("conv_layers", 1, 3, default=2)
    filters = hp.Int("filters", 32, 128, step=32, default=64)
    kernel_size = hp.Choice("kernel_size", [3, 5, 7], default=5)
    inputs = keras.Input(shape=(WIDTH, CHANNELS))
    x = inputs
    for _ in range(depth):
        x = layers.Conv1D(filters, kernel_size, padding="same", activation="relu")(x)
    outputs = layers.Conv1D(N_STATES, 1, activation="softmax")(x)  # a state per residue
    model = keras.Model(inputs, outputs, name="protein_per_residue")
    model.compile(optimizer=keras.optimizers.Adam(hp.Float("learning_rate", 1e-4, 1e-2, sampling="log",
                                                           default=1e-3)),
                  loss=keras.losses.SparseCategoricalCrossentropy(ignore_class=-1), metrics=[Q3()])
    return model
