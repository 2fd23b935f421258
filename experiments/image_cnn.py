"""An image classifier as keras.io writes one, for the built-in `shapes` (32x32 RGB, 10 classes)
or your own image folder: augmentation layers applied to the inputs, Conv2D blocks with
BatchNormalization, global pooling, Dropout; as a KerasTuner hypermodel.

The input size is the data's (built on its samples), the classes are N_CLASSES.
"""

import keras
from keras import layers

N_CLASSES = 10


def build(hp):
    width = hp.Int("width", 16, 64, step=16, default=32)
    depth = hp.Int("conv_blocks", 2, 4, default=3)
    dropout = hp.Float("dropout", 0.0, 0.5, step=0.1, default=0.3)

    data_augmentation = keras.Sequential(
        [
            layers.RandomFlip("horizontal"),
            layers.RandomContrast(0.2),
            layers.RandomBrightness(0.1),
        ],
        name="data_augmentation",
    )
    model = keras.Sequential(name="image_cnn")
    model.add(data_augmentation)
    model.add(layers.Rescaling(1.0 / 255))
    for block in range(depth):
        model.add(layers.Conv2D(width * 2**block, 3, padding="same", use_bias=False))
        model.add(layers.BatchNormalization(momentum=0.9))  # moving averages that keep up with a short training
        model.add(layers.Activation("relu"))
        if block < depth - 1:
            model.add(layers.MaxPooling2D(2))
    model.add(layers.GlobalAveragePooling2D())
    model.add(layers.Dropout(dropout))
    model.add(layers.Dense(N_CLASSES, activation="softmax"))
    return model
