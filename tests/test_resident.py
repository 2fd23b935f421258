"""Device-resident data: one host-to-device copy per dataset per process; XLA choice by rule."""

from __future__ import annotations

import numpy as np

from pipeline import resident
from pipeline.training import XLA_MAX_BATCH_ON_CPU, has_random_layers, use_xla


def test_a_dataset_is_copied_to_the_device_once_per_process():
    x = np.arange(24, dtype=np.float32).reshape(6, 4, 1)
    y = np.arange(6, dtype=np.int32) % 2
    before = resident.transfers()
    first = resident.resident_data("fingerprint-a", x, y)
    again = resident.resident_data("fingerprint-a", x, y)
    assert resident.transfers() == before + 1
    assert again is first
    np.testing.assert_array_equal(first.x.numpy(), x)
    np.testing.assert_array_equal(first.y.numpy(), y)
    resident.resident_data("fingerprint-b", x, y)
    assert resident.transfers() == before + 2


def test_cpu_without_gpu_gets_a_notice():
    assert "training on CPU" in resident.configure_devices(0.5)


def test_xla_rule_follows_batch_size_on_cpu_and_can_be_forced():
    assert use_xla("auto", batch_size=8, device="/CPU:0")
    assert use_xla("auto", batch_size=XLA_MAX_BATCH_ON_CPU, device="/CPU:0")
    assert not use_xla("auto", batch_size=XLA_MAX_BATCH_ON_CPU * 2, device="/CPU:0")
    assert use_xla("auto", batch_size=1024, device="/GPU:0")
    assert not use_xla("off", batch_size=8, device="/CPU:0")
    assert use_xla("on", batch_size=1024, device="/CPU:0")
    assert not use_xla("auto", batch_size=8, device="/CPU:0", stochastic=True)
    assert use_xla("auto", batch_size=8, device="/GPU:0", stochastic=True)


def test_random_layers_are_detected():
    import keras

    inputs = keras.Input((4, 1))
    plain = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(inputs)))
    noisy = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dropout(0.1)(keras.layers.Flatten()(inputs))))
    assert not has_random_layers(plain) and has_random_layers(noisy)
