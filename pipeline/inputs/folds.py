"""Folds: a seeded scikit-learn splitter run once per data and CV spec (later commands read its
folds back, ``remembered_folds``), and the manifest that pins them.

With ``cv.n_repeats`` > 1 the splitter runs once per repeat, each with its own shuffle, and a
trial trains every (repeat, fold) as one replica; replica ``j`` is ``repeat * n_splits + fold``,
scikit-learn's order for repeated splitters (``split{j}`` of ``cross_validate``).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import hashlib
import json
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.base import bounded_cache
from pipeline.base.environment import cache_directory, installed_version
from pipeline.base.errors import DataError
from pipeline.base.forking import may_fork_beside
from pipeline.inputs.datasets import Dataset
from pipeline.inputs.scoring import is_regression
from pipeline.inputs.spec import CVSpec

if TYPE_CHECKING:
    from multiprocessing.connection import Connection


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
            "n_samples": int(sum(len(fold.val) for fold in self.folds[: self.cv.n_splits])),
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
    grouped = cv.grouped
    if stratified and (is_regression(dataset.y) or np.asarray(dataset.y).ndim > 1):
        what = "float (regression) targets" if is_regression(dataset.y) else "labels per position"
        raise DataError(
            f"cv.splitter {cv.splitter} keeps each class's share of the samples in every fold, and "
            f"{dataset.name!r} has {what}, not one class per sample: use cv.splitter: "
            "kfold, or group to keep related samples together"
        )
    if stratified:
        counts = np.bincount(dataset.y)
        smallest = int(counts[counts > 0].min())
        if cv.n_splits > smallest:
            raise DataError(
                f"cv.n_splits must be <= the smallest class size ({smallest}) for {cv.splitter} CV, got {cv.n_splits}"
            )
    groups = None
    if grouped:
        if dataset.groups is None:
            raise DataError(
                f"cv.splitter {cv.splitter} needs groups, but dataset {dataset.name!r} has none "
                "(a groups array in the data file)"
            )
        groups = np.asarray(dataset.groups)
        n_groups = len(np.unique(groups))
        if cv.n_splits > n_groups:
            raise DataError(f"cv.n_splits must be <= the number of groups ({n_groups}), got {cv.n_splits}")
    folds = tuple(
        Fold(train=train.astype(np.int64), val=val.astype(np.int64))
        for train, val in _splits(cv, np.zeros(n_samples), dataset.y, groups)
    )
    return FoldPlan(cv=cv, folds=folds, dataset_fingerprint=dataset.fingerprint)


def folds_beside(cv: CVSpec, dataset: Dataset) -> Callable[[], FoldPlan]:
    """``make_folds`` started in a child process where that saves the command time; returns
    what waits for the folds and raises what ``make_folds`` raised, at the moment it is called.

    Folds split before for the same data and ``cv`` are read back from the cache
    (``remembered_folds``), with the warnings their split gave, and nothing is split.
    Importing scikit-learn's splitters is ~1.2 s of a command's start-up on 2 cores, while the
    next seconds load TensorFlow on one core: a child forked before that splits on the other, and
    the command itself never loads scikit-learn. A process that may fork no helper
    (``may_fork_beside``: off Linux, or with TensorFlow or Ray loaded, as a notebook or the tests),
    or that has loaded scikit-learn, where there is nothing to gain, splits in place when asked.
    """
    remembered = remembered_folds(cv, dataset)
    if remembered is not None:
        plan, warned = remembered
        return functools.cache(lambda: _warned_again(plan, warned))
    if not may_fork_beside() or "sklearn.model_selection" in sys.modules:
        return functools.cache(lambda: _split_in_place(cv, dataset))
    return _SplitBeside(cv, dataset)


Warned = Sequence[tuple[str, type[Warning]]]  # a split's warnings: each message and its category


def _warned_again(answer: Any, warned: Warned) -> Any:
    """``answer`` (the folds or a refusal), once the split's warnings are shown again."""
    for message, category in warned:
        warnings.warn(message, category, stacklevel=3)
    return answer


def _split_in_place(cv: CVSpec, dataset: Dataset) -> FoldPlan:
    """``make_folds`` here, its warnings shown and the folds remembered with them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning is kept; the filters apply as each is shown
        plan = make_folds(cv, dataset)
    warned = [(str(warning.message), warning.category) for warning in caught]
    remember_folds(plan, warned)
    return _warned_again(plan, warned)


# Where split folds are kept (``remember_folds``): a seeded splitter splits the same labels and
# groups into the same folds every time, so a later command on the same data and ``cv`` reads
# them back instead of loading scikit-learn to split them again (``folds_beside``). Keyed by the
# data's fingerprint, the CV spec, the scikit-learn and NumPy that split, and this module's
# source (how it calls the splitters: a change splits again).
FOLDS_CACHE = "folds"
# What the remembered folds may take on disk; past it the least recently used go. A fold is kept
# as its samples' indices in int32, 4 bytes a sample (3 MB for 3 folds of 250,000 samples).
FOLDS_CACHE_LIMIT_BYTES = 256 * 2**20


def folds_cache() -> Path:
    """The directory of the remembered folds, in foldsweep's cache directory."""
    return cache_directory() / FOLDS_CACHE


def _remembered_path(cv: CVSpec, data_fingerprint: str) -> Path:
    split_by = {"cv": asdict(cv), "data": data_fingerprint}
    split_by["versions"] = {name: installed_version(name) for name in ("scikit-learn", "numpy")}
    split_by["splitting"] = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps(split_by, sort_keys=True).encode()).hexdigest()[:32]
    return folds_cache() / f"{key}.npz"


def remember_folds(plan: FoldPlan, warned: Warned) -> None:
    """Keep ``plan``'s folds and the warnings of their split for ``remembered_folds`` (nothing
    where the cache cannot be written, or a warning's category is not Python's own), within
    ``FOLDS_CACHE_LIMIT_BYTES``: the least recently used folds go first."""
    if any(getattr(builtins, category.__name__, None) is not category for _, category in warned):
        return
    path = _remembered_path(plan.cv, plan.dataset_fingerprint)
    arrays = {
        f"{side}{k}": getattr(fold, side).astype(np.int32)
        for k, fold in enumerate(plan.folds)
        for side in ("train", "val")
    }
    meta = json.dumps(
        {"folds": len(plan.folds), "warnings": [[message, category.__name__] for message, category in warned]}
    )
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.stem}.{os.getpid()}.npz")
        try:
            np.savez(scratch, meta=np.array(meta), **arrays)
            os.replace(scratch, path)
        finally:
            scratch.unlink(missing_ok=True)
        bounded_cache.prune(path.parent, "[!.]*.npz", FOLDS_CACHE_LIMIT_BYTES)  # not another's scratch


def remembered_folds(cv: CVSpec, dataset: Dataset) -> tuple[FoldPlan, Warned] | None:
    """The folds split before for this data and ``cv`` (``remember_folds``) and the warnings their
    split gave; None where none were kept, or what was kept is not a split of this data's samples
    (each fold's training and validation indices together are every sample once)."""
    path = _remembered_path(cv, dataset.fingerprint)
    try:
        with np.load(path, allow_pickle=False) as kept:
            meta = json.loads(str(kept["meta"]))
            folds = tuple(
                Fold(train=kept[f"train{k}"].astype(np.int64), val=kept[f"val{k}"].astype(np.int64))
                for k in range(meta["folds"])
            )
            warned = [(message, getattr(builtins, category)) for message, category in meta["warnings"]]
    except Exception:  # none kept, or not readable as kept: split
        return None
    if len(folds) != cv.replicas or not _splits_every_sample(folds, n_samples=len(dataset.y), n_splits=cv.n_splits):
        return None
    if not all(isinstance(category, type) and issubclass(category, Warning) for _, category in warned):
        return None
    bounded_cache.mark_used(path)
    return FoldPlan(cv=cv, folds=folds, dataset_fingerprint=dataset.fingerprint), warned


def _splits_every_sample(folds: Sequence[Fold], *, n_samples: int, n_splits: int) -> bool:
    """Whether each fold trains and validates on every sample once between them, and each
    repeat's ``n_splits`` folds validate on every sample once."""

    def once_each(indices: Sequence[np.ndarray]) -> bool:
        joined = np.concatenate(indices)
        return bool(joined.size == n_samples and joined.min() >= 0 and joined.max() < n_samples) and bool(
            (np.bincount(joined, minlength=n_samples) == 1).all()
        )

    repeats = [folds[start : start + n_splits] for start in range(0, len(folds), n_splits)]
    return all(once_each([fold.train, fold.val]) for fold in folds) and all(
        once_each([fold.val for fold in repeat]) for repeat in repeats
    )


class _SplitBeside:
    """A child process splitting the folds, and the command's wait for its answer."""

    def __init__(self, cv: CVSpec, dataset: Dataset):
        import multiprocessing

        self._cv, self._dataset = cv, dataset
        _ = dataset.fingerprint  # hashed once, before the fork: the command's and the child's
        context = multiprocessing.get_context("fork")
        self._receiver, sender = context.Pipe(duplex=False)
        # A Ctrl-C between the fork and the child ignoring it would end the child with a traceback.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self._child = context.Process(
                target=_send_folds, args=(self._receiver, sender, cv, dataset), name="foldsweep-folds", daemon=True
            )
            self._child.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        sender.close()
        self._answer: FoldPlan | DataError | None = None

    def __call__(self) -> FoldPlan:
        if self._answer is None:
            self._answer = self._receive()
        if isinstance(self._answer, DataError):
            raise self._answer
        return self._answer

    def _receive(self) -> FoldPlan | DataError:
        try:
            answer, warned = self._receiver.recv()
        except Exception:  # the child died, or sent what cannot be read back
            answer, warned = None, []
        finally:
            self._receiver.close()
            self._child.kill()  # it has answered, or is no longer waited for (Ctrl-C)
            self._child.join()
        if answer is None:
            try:  # here, so that anything but a refusal comes with its own traceback
                return _split_in_place(self._cv, self._dataset)
            except DataError as refused:
                return refused
        if isinstance(answer, FoldPlan):
            remember_folds(answer, warned)
        _warned_again(answer, warned)
        return answer


def _send_folds(receiver: Connection, sender: Connection, cv: CVSpec, dataset: Dataset) -> None:
    """The child's whole life: the folds, a refusal, or None (the command splits in place), and
    the warnings the split gave, sent; then it leaves at once, flushing none of the command's
    output buffers it holds copies of and running none of its exit handlers. It writes nothing
    itself: a stream it shares with the command (a terminal's live line) may be locked by a
    thread that the fork left behind."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the command's to report
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        receiver.close()  # with no reader left, a command that is gone fails the send: the child ends
        answer: FoldPlan | DataError | None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every warning is sent; the command's filters apply as each is shown
            try:
                answer = make_folds(cv, dataset)
            except DataError as refused:
                answer = refused
            except Exception:
                answer = None
        sender.send((answer, [(str(warning.message), warning.category) for warning in caught]))
    finally:
        os._exit(0)


def _splits(
    cv: CVSpec, x: np.ndarray, y: np.ndarray, groups: np.ndarray | None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every repeat's folds in order. scikit-learn has repeated splitters for plain and stratified
    k-fold; the grouped ones repeat the same way (one random state drawn on across repeats, so
    repeat 0 is the unrepeated split and each later one a new shuffle of whole groups)."""
    # Imported here: a Ray worker loads this module for its ``Fold``s but never splits, and
    # scikit-learn was ~1 s of its start-up.
    from sklearn.model_selection import GroupKFold, RepeatedKFold, RepeatedStratifiedKFold, StratifiedGroupKFold

    if cv.splitter == "kfold":
        return RepeatedKFold(n_splits=cv.n_splits, n_repeats=cv.n_repeats, random_state=cv.seed).split(x, y)
    if cv.splitter == "stratified":
        return RepeatedStratifiedKFold(n_splits=cv.n_splits, n_repeats=cv.n_repeats, random_state=cv.seed).split(x, y)
    splitter = {"group": GroupKFold, "stratified_group": StratifiedGroupKFold}[cv.splitter]
    shuffles = np.random.RandomState(cv.seed)
    return (
        split
        for _ in range(cv.n_repeats)
        for split in splitter(n_splits=cv.n_splits, shuffle=True, random_state=shuffles).split(x, y, groups)
    )


# How far a fold's validation classes may drift from the whole data's before a warning: the
# total-variation distance, half the summed absolute differences of the class shares, i.e. the
# fraction of the fold's samples that would have to change class for the two to match. 0.2, a
# fifth of the fold, is far past chance: folds of 100 samples drawn one at a time stray about 0.06
# from three balanced classes (0.14 in one fold out of a hundred), while [42, 210, 168] against a
# balanced whole is 0.23. Groups move whole, each often mostly one class, which is what pushes a
# group fold past it.
IMBALANCE_THRESHOLD = 0.2


def class_balance_warning(plan: FoldPlan, y: np.ndarray) -> str | None:
    """One line naming the validation fold whose class shares stray furthest from the whole
    data's, when ``cv.splitter`` is ``group`` and that distance exceeds ``IMBALANCE_THRESHOLD``;
    None otherwise. ``y`` is the labels the plan's indices point into (the CV training split); a
    fold is named by its replica index, ``repeat * n_splits + fold`` as everywhere else.

    Only ``group`` is checked: the stratified splitters keep the proportions by construction, and
    ``kfold`` draws samples one at a time, so its folds stray only by chance."""
    if plan.cv.splitter != "group" or not plan.folds or is_regression(y) or np.asarray(y).ndim > 1:
        return None
    y = np.asarray(y)
    n_classes = int(y.max()) + 1
    overall = np.bincount(y, minlength=n_classes) / len(y)
    distances, counts = [], []
    for fold in plan.folds:
        fold_counts = np.bincount(y[fold.val], minlength=n_classes)
        counts.append(fold_counts)
        distances.append(0.5 * float(np.abs(fold_counts / max(len(fold.val), 1) - overall).sum()))
    worst = int(np.argmax(distances))
    if distances[worst] <= IMBALANCE_THRESHOLD:
        return None
    unbalanced = sum(distance > IMBALANCE_THRESHOLD for distance in distances)
    others = f"; {unbalanced} of {len(plan.folds)} folds are past it" if unbalanced > 1 else ""
    shares = counts[worst] / counts[worst].sum()
    return (
        f"cv.splitter group: fold {worst} validates on class counts {counts[worst].tolist()} "
        f"({_percentages(shares)}) while the data has {_percentages(overall)}, a total-variation distance "
        f"of {distances[worst]:.2f} (over {IMBALANCE_THRESHOLD}){others}: its score measures another class "
        "mix than the data's; cv.splitter: stratified_group keeps groups whole and each fold's classes "
        "close to the data's"
    )


def _percentages(shares: np.ndarray) -> str:
    return "/".join(f"{100 * share:.0f}%" for share in shares)
