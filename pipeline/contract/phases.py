"""What a trial's worker is doing before its first epoch ends, told to the sweep's driver.

A worker's first trial spends seconds starting TensorFlow and placing the data on its device, and
every trial builds its fold models and compiles its first epoch before it reports anything to Ray
Tune. Each phase is written to Ray's key-value store as it begins (a report would count as an
epoch), under the trial's id, and the driver's progress view reads them: a terminal says what
every running trial is doing from its first second.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from pipeline.base.ray_private import kv_delete, kv_get_all, kv_put

# foldsweep's namespace in Ray's internal key-value store.
NAMESPACE = "foldsweep"


class Phase(StrEnum):
    """A trial's phase before its first epoch ends, in order."""

    STARTING = "starting a worker"  # the driver's own: Ray has placed the trial, its process starts
    TENSORFLOW = "starting TensorFlow"
    DATA = "placing the data on the device"
    MODELS = "building the fold models"
    FIRST_EPOCH = "epoch 1 (compiling)"


PHASES = frozenset(phase.value for phase in Phase)


def _key(trial_id: str) -> bytes:
    return f"phase:{trial_id}".encode()


def announce(trial_id: str | None, phase: Phase) -> None:
    """Tell the driver that ``trial_id`` begins ``phase`` (nothing outside a Ray worker)."""
    import ray

    if trial_id is None or not ray.is_initialized():
        return
    kv_put(_key(trial_id), phase.value.encode(), namespace=NAMESPACE)


def phases(trial_ids: Iterable[str]) -> dict[str, Phase]:
    """The phase each of ``trial_ids`` announced last (those that announced none are left out)."""
    import ray

    if not ray.is_initialized():
        return {}
    keys = {_key(trial_id): trial_id for trial_id in trial_ids}
    found = {}
    for key, value in kv_get_all(keys, namespace=NAMESPACE).items():
        if value.decode() in PHASES:  # a worker of another release says what this one cannot
            found[keys[key]] = Phase(value.decode())
    return found


def forget(trial_id: str) -> None:
    """Drop an ended trial's phase from the store."""
    import ray

    if not ray.is_initialized():
        return
    kv_delete(_key(trial_id), namespace=NAMESPACE)
