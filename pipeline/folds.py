"""Folds: a seeded scikit-learn splitter run once per sweep, and the manifest that pins it.

With ``cv.n_repeats`` > 1 the splitter runs once per repeat, each with its own shuffle, and a
trial trains every (repeat, fold) as one replica; replica ``j`` is ``repeat * n_splits + fold``,
scikit-learn's order for repeated splitters (``split{j}`` of ``cross_validate``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np
from sklearn.model_selection import (GroupKFold, RepeatedKFold, RepeatedStratifiedKFold, StratifiedGroupKFold)

from pipeline.datasets import Dataset
from pipeline.errors import DataError
from pipeline.spec import CVSpec


@dataclass(frozen=True)
class Fold:
    train: np.ndarray
    val: np.ndarray


@dataclass(frozen=True)
class FoldPlan:
    """The index arrays every trial of a sweep trains and validates on."""

    cv: CVSpec
    folds: tuple[Fold, ...]
    dataset_fingerprint: str

    def __len__(self) -> int:
        return len(self.folds)

    def manifest(self) -> dict[str, Any]:
        """What identifies these folds: sizes and a hash of each fold's index arrays."""
        return {
            "splitter": self.cv.splitter,
            "n_splits": self.cv.n_splits,
            "n_repeats": self.cv.n_repeats,
            "seed": self.cv.seed,
            "dataset_fingerprint": self.dataset_fingerprint,
            "n_samples": int(sum(len(fold.val) for fold in self.folds[:self.cv.n_splits])),
            "folds": [
                {
                    "fold": k,
                    "repeat": k // self.cv.n_splits,
                    "fold_in_repeat": k % self.cv.n_splits,
                    "train_size": int(len(fold.train)),
                    "val_size": int(len(fold.val)),
                    "train_sha256": _hash_indices(fold.train),
                    "val_sha256": _hash_indices(fold.val),
                }
                for k, fold in enumerate(self.folds)
            ],
        }


def manifest_identity(manifest: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What makes two manifests the same folds: each replica's index hashes, in order."""
    return [(fold["train_sha256"], fold["val_sha256"]) for fold in manifest["folds"]]


def _hash_indices(indices: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(indices, dtype=np.int64).tobytes()).hexdigest()


def make_folds(cv: CVSpec, dataset: Dataset) -> FoldPlan:
    """Split the dataset's CV training split with a seeded scikit-learn splitter.

    Raises:
        DataError: more splits than samples, (stratified) than members of the smallest class,
            or (grouped) than groups; grouped CV on data without groups.
    """
    n_samples = len(dataset.y)
    if cv.n_splits > n_samples:
        raise DataError(f"cv.n_splits must be <= the number of samples ({n_samples}), got {cv.n_splits}")
    stratified = cv.splitter in ("stratified", "stratified_group")
    grouped = cv.splitter in ("group", "stratified_group")
    if stratified:
        counts = np.bincount(dataset.y)
        smallest = int(counts[counts > 0].min())
        if cv.n_splits > smallest:
            raise DataError(
                f"cv.n_splits must be <= the smallest class size ({smallest}) for {cv.splitter} CV, got {cv.n_splits}")
    groups = None
    if grouped:
        if dataset.groups is None:
            raise DataError(f"cv.splitter {cv.splitter} needs groups, but dataset {dataset.name!r} has none "
                            "(a groups array in the data file)")
        groups = np.asarray(dataset.groups)
        n_groups = len(np.unique(groups))
        if cv.n_splits > n_groups:
            raise DataError(f"cv.n_splits must be <= the number of groups ({n_groups}), got {cv.n_splits}")
    folds = tuple(
        Fold(train=train.astype(np.int64), val=val.astype(np.int64))
        for train, val in _splits(cv, np.zeros(n_samples), dataset.y, groups)
    )
    return FoldPlan(cv=cv, folds=folds, dataset_fingerprint=dataset.fingerprint)


def _splits(cv: CVSpec, x: np.ndarray, y: np.ndarray,
            groups: np.ndarray | None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every repeat's folds in order. scikit-learn has repeated splitters for plain and stratified
    k-fold; the grouped ones repeat the same way (one random state drawn on across repeats, so
    repeat 0 is the unrepeated split and each later one a new shuffle of whole groups)."""
    if cv.splitter == "kfold":
        return RepeatedKFold(n_splits=cv.n_splits, n_repeats=cv.n_repeats, random_state=cv.seed).split(x, y)
    if cv.splitter == "stratified":
        return RepeatedStratifiedKFold(n_splits=cv.n_splits, n_repeats=cv.n_repeats,
                                       random_state=cv.seed).split(x, y)
    splitter = {"group": GroupKFold, "stratified_group": StratifiedGroupKFold}[cv.splitter]
    shuffles = np.random.RandomState(cv.seed)
    return (split for _ in range(cv.n_repeats)
            for split in splitter(n_splits=cv.n_splits, shuffle=True, random_state=shuffles).split(x, y, groups))
