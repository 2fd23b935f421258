"""A spec checked against its inputs before TensorFlow or Ray loads: the store, the experiment's
file, the data, its labels and groups, the Ray address (``check_inputs``, well under a second:
a missing file, a misnamed array or a bad label is reported at once); and the folds made of the
data, once the model is known (``make_checked_folds``: a count of replicas too large for the
model's memory is refused before its folds are made).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.base.errors import DataError, SpecError
from pipeline.inputs.datasets import Dataset, load_dataset
from pipeline.inputs.spec import GROUPED_SPLITTERS, SweepSpec


@dataclass(frozen=True)
class CheckedInputs:
    """What a sweep reads, checked: the store's URI, the experiment's file, the data, its folds."""

    tracking_uri: str
    experiment_path: Path
    dataset: Dataset
    dataset_path: str | None  # a data file, absolute (None for a built-in)
    num_samples: int
    address: str | None
    warnings: tuple[str, ...] = ()  # what may be a mistake but is not refused


def check_inputs(spec: SweepSpec, *, tracking_uri: str | None = None, num_samples: int | None = None,
                 address: str | None = None) -> CheckedInputs:
    """Every check of a spec's inputs that needs no model, TensorFlow, Ray or folds.

    Raises:
        InputError: the store, experiment file, data or Ray address cannot work as asked.
    """
    from pipeline.records.stores import check_tracking_uri

    uri = tracking_uri or spec.tracking.uri
    check_tracking_uri(uri, source="--tracking-uri" if tracking_uri else f"{spec.source_path}: tracking.uri")
    if num_samples is not None and num_samples < 1:
        raise DataError(f"--num-samples must be >= 1, got {num_samples}")
    experiment_path = spec.resolve_path(spec.experiment_path, key="experiment")
    dataset_spec = spec.resolved_dataset()
    dataset = load_dataset(dataset_spec)
    source = dataset_spec.path or dataset.name  # what the messages name: the file, or the built-in
    _check_classes(dataset, source)
    _check_groups_kept_whole(spec, dataset, source)
    address = _checked_address(spec, address)
    warnings = []
    if spec.cv.groups == "ignore" and dataset.groups is None:
        warnings.append(f"cv.groups: ignore has nothing to ignore: {source!r} has no groups")
    return CheckedInputs(tracking_uri=uri, experiment_path=experiment_path, dataset=dataset,
                         dataset_path=dataset_spec.path, num_samples=num_samples or spec.search.num_samples,
                         address=address, warnings=tuple(warnings))


def make_checked_folds(spec: SweepSpec, inputs: CheckedInputs) -> tuple[Any, tuple[str, ...]]:
    """The sweep's folds (``pipeline.inputs.folds.FoldPlan``), each training on two classes at
    least, and the warnings they earn (a grouped fold whose classes stray from the data's).

    Raises:
        DataError: more splits than the data allows, or a fold that trains on one class.
    """
    from pipeline.inputs.folds import class_balance_warning, make_folds

    dataset = inputs.dataset
    folds = make_folds(spec.cv, dataset)
    _check_folds_have_classes(spec, dataset, folds, inputs.dataset_path or dataset.name)
    warning = class_balance_warning(folds, dataset.y)
    return folds, (warning,) if warning else ()


def _check_classes(dataset: Dataset, source: str) -> None:
    """A classifier needs two classes: with one, every trial scores a trivial accuracy of 1."""
    if dataset.y.dtype.kind == "f" or dataset.y.ndim > 1:  # regression targets; labels per position (at validate)
        return
    classes = np.unique(dataset.y)
    if len(classes) < 2:
        raise DataError(f"dataset: y of {source!r} has a single class (every label is {int(classes[0])}); "
                        "a classifier needs samples of at least two classes")


def _check_groups_kept_whole(spec: SweepSpec, dataset: Dataset, source: str) -> None:
    """Data that carries groups (windows of one protein, recordings of one patient) is split with
    them kept whole, unless the spec ignores them on purpose: a splitter that ignores them puts
    near-copies of a validation sample in its training fold, and the scores come out optimistic
    (stratified CV scored a protein-window config 0.753 where group CV scored it 0.574)."""
    if dataset.groups is None or spec.cv.grouped or spec.cv.groups == "ignore":
        return
    n_groups = len(np.unique(dataset.groups))
    raise SpecError(
        f"{spec.source_path}: cv.splitter {spec.cv.splitter} ignores the groups of {source!r} ({n_groups:,} groups "
        f"over {len(dataset.y):,} samples): samples of one group would land on both sides of a fold, and the CV "
        f"scores would be optimistic; use cv.splitter: {' | '.join(GROUPED_SPLITTERS)}, or set cv.groups: ignore "
        "to split without them on purpose (recorded with the sweep)")


def _check_folds_have_classes(spec: SweepSpec, dataset: Dataset, folds: Any, source: str) -> None:
    if dataset.y.dtype.kind == "f" or dataset.y.ndim > 1:
        return
    for j, fold in enumerate(folds.folds):
        classes = np.unique(dataset.y[fold.train])
        if len(classes) < 2:
            hint = " (stratified_group keeps the classes' proportions in every fold)" \
                if spec.cv.splitter == "group" else ""
            raise DataError(
                f"{spec.source_path}: cv.splitter {spec.cv.splitter}: fold {j} of {source!r} trains on a "
                f"single class ({int(classes[0])}), so its model can only learn to predict it; use fewer "
                f"cv.n_splits, more groups, or another splitter{hint}")


def _checked_address(spec: SweepSpec, address: str | None) -> str | None:
    """The Ray cluster to join (None: a local Ray), refused at once where nothing answers."""
    # Ray itself would join the cluster $RAY_ADDRESS names: it is an input like the flag and the key.
    source = "--address" if address else "resources.address" if spec.resources.address else "RAY_ADDRESS"
    address = address or spec.resources.address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        check_ray_address(address, source=source)
    if address is None and spec.resources.cpu > (os.cpu_count() or 1):
        raise SpecError(f"{spec.source_path}: resources.cpu must be <= the CPUs of this machine "
                        f"({os.cpu_count()}), got {spec.resources.cpu:g}")
    return address


def check_ray_address(address: str, *, source: str = "--address") -> None:
    """Refuse a Ray address where nothing listens, at once: ray.init would wait minutes for it.

    Raises:
        InputError: malformed address, or no answer on its port.
    """
    import socket

    from pipeline.base.errors import InputError

    if address in ("auto", "local") or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"{source} must be host:port (e.g. 127.0.0.1:6379), got {address!r}")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except OSError as exc:
        raise InputError(f"{source}: no Ray cluster answers at {address!r}: "
                         f"{exc.strerror or exc}") from None
