"""Device-resident data: one host-to-device copy per dataset per process."""

from __future__ import annotations

import numpy as np

from pipeline.engine import resident


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
