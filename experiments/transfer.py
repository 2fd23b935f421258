"""Transfer learning as keras.io's guide does it, for the built-in `shapes` or your own images: a
keras.applications MobileNetV2 base, frozen and called in inference mode, under a new head; with
`fine_tune_at` > 0 the base's layers from that index on train too (fine-tuning).

The base starts from random weights (`weights=None`: nothing is downloaded) unless
`search.space.base_weights` names a local weights file (a MobileNetV2 without its top, alpha
0.35, saved with `base.save_weights(...)`), which every fold loads: frozen weights the same in
every fold are held once for all of them when the folds are stacked.
"""

import keras
from keras import layers

N_CLASSES = 10


def build(hp):
    weights = hp.Fixed("base_weights", "")
    fine_tune_at = hp.Int("fine_tune_at", 0, 150, step=50, default=0)
    dropout = hp.Float("dropout", 0.0, 0.5, step=0.1, default=0.2)

    inputs = keras.Input(shape=(32, 32, 3))
    x = layers.RandomFlip("horizontal")(inputs)
    x = layers.Rescaling(1.0 / 127.5, offset=-1.0)(x)  # MobileNetV2's input range
    base = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, include_top=False, weights=None)
    if weights:
        base.load_weights(weights)
    base.trainable = bool(fine_tune_at)
    for layer in base.layers[:fine_tune_at]:
        layer.trainable = False
    x = base(x, training=False)  # BatchNormalization in inference mode, frozen or not
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(dropout)(x)
    outputs = layers.Dense(N_CLASSES, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="transfer")
