"""The image models the benchmarks time, built in `build(hp)` as keras.io writes them, on the
built-in `shapes` (32x32x3, 10 classes): an experiment module (`benchmarks/image_models.py:NAME`).

- `image_cnn`: 4 x (Conv2D + MaxPooling2D), GlobalAveragePooling2D, a softmax head;
- `image_cnn_aug`: the same with BatchNormalization, RandomFlip + RandomContrast in the model
  (layers foldsweep draws for) and Dropout;
- `mobilenet_v2`: `keras.applications.MobileNetV2(alpha=0.35, weights=None, classes=10)`;
- `transfer`: RandomFlip, a nested MobileNetV2 base (`include_top=False`), global pooling,
  Dropout and a Dense head.
"""

import keras
from keras import layers

# The built-in shapes the image models are timed on: 3,594 images in CV after its 20 % test split.
SHAPES_OPTIONS = {"num_samples": 4493}
NAMES = ("image_cnn", "image_cnn_aug", "mobilenet_v2", "transfer")


def image_cnn(hp, batch_norm=False, augment=False):
    inputs = keras.Input(shape=(32, 32, 3))
    x = inputs
    if augment:
        x = layers.RandomContrast(0.2)(layers.RandomFlip("horizontal")(x))
    x = layers.Rescaling(1.0 / 255)(x)
    for filters in (32, 64, 64, 128):
        x = layers.Conv2D(filters, 3, padding="same", use_bias=not batch_norm)(x)
        if batch_norm:
            x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.MaxPooling2D(2)(x)
    x = layers.GlobalAveragePooling2D()(x)
    if augment:
        x = layers.Dropout(0.3)(x)
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(x))


def image_cnn_aug(hp):
    return image_cnn(hp, batch_norm=True, augment=True)


def mobilenet_v2(hp):
    return keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10)


def transfer(hp):
    inputs = keras.Input(shape=(32, 32, 3))
    x = layers.RandomFlip("horizontal")(inputs)
    base = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, include_top=False, weights=None)
    x = layers.GlobalAveragePooling2D()(base(x))
    x = layers.Dropout(0.2)(x)
    return keras.Model(inputs, layers.Dense(10, activation="softmax")(x))
