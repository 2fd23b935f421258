"""Folds are made once, cover every sample exactly once, and are identical for the same seed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO

from pipeline.base.errors import DataError
from pipeline.inputs import folds as folds_module
from pipeline.inputs.datasets import Dataset
from pipeline.inputs.folds import (
    Fold,
    FoldPlan,
    class_balance_warning,
    folds_beside,
    make_folds,
    manifest_identity,
    remember_folds,
    remembered_folds,
)
from pipeline.inputs.spec import CVSpec


@pytest.fixture(autouse=True)
def folds_cache(monkeypatch, tmp_path):
    """The remembered folds kept in the test's own directory, none at its start."""
    cache = tmp_path / "folds-cache"
    monkeypatch.setattr(folds_module, "folds_cache", lambda: cache)
    return cache


def dataset(n: int = 103, classes: int = 3) -> Dataset:
    rng = np.random.default_rng(7)
    return Dataset(
        name="toy", x=rng.normal(size=(n, 8, 1)).astype(np.float32), y=(np.arange(n) % classes).astype(np.int32)
    )


@pytest.mark.parametrize("splitter", ["kfold", "stratified"])
def test_every_sample_is_validated_exactly_once(splitter):
    data = dataset()
    plan = make_folds(CVSpec(splitter=splitter, n_splits=4, seed=3), data)
    counts = np.bincount(np.concatenate([fold.val for fold in plan.folds]), minlength=len(data.y))
    assert counts.tolist() == [1] * len(data.y)
    for fold in plan.folds:
        assert np.intersect1d(fold.train, fold.val).size == 0
        assert len(fold.train) + len(fold.val) == len(data.y)


@pytest.mark.parametrize("splitter", ["kfold", "stratified"])
def test_same_seed_same_folds_other_seed_other_folds(splitter):
    data = dataset()
    first = make_folds(CVSpec(splitter=splitter, n_splits=3, seed=11), data)
    again = make_folds(CVSpec(splitter=splitter, n_splits=3, seed=11), data)
    other = make_folds(CVSpec(splitter=splitter, n_splits=3, seed=12), data)
    for a, b in zip(first.folds, again.folds):
        np.testing.assert_array_equal(a.val, b.val)
        np.testing.assert_array_equal(a.train, b.train)
    assert first.manifest() == again.manifest()
    assert first.manifest()["folds"] != other.manifest()["folds"]


def test_stratified_folds_keep_class_proportions():
    data = dataset(n=300, classes=3)
    plan = make_folds(CVSpec(splitter="stratified", n_splits=5, seed=0), data)
    for fold in plan.folds:
        assert np.bincount(data.y[fold.val]).tolist() == [20, 20, 20]


def test_manifest_records_sizes_hashes_and_the_data():
    data = dataset()
    manifest = make_folds(CVSpec(splitter="kfold", n_splits=3, seed=0), data).manifest()
    assert manifest["dataset_fingerprint"] == data.fingerprint
    assert manifest["n_samples"] == 103
    assert [fold["val_size"] for fold in manifest["folds"]] == [35, 34, 34]
    assert all(len(fold["val_sha256"]) == 64 for fold in manifest["folds"])
    assert len({fold["val_sha256"] for fold in manifest["folds"]}) == 3


def test_more_splits_than_samples_is_refused():
    with pytest.raises(DataError, match=r"cv.n_splits must be <= the number of samples \(6\), got 7"):
        make_folds(CVSpec(splitter="kfold", n_splits=7, seed=0), dataset(n=6))


def test_more_splits_than_the_smallest_class_is_refused_for_stratified():
    data = Dataset(name="toy", x=np.zeros((20, 4, 1), np.float32), y=np.array([0] * 17 + [1] * 3, np.int32))
    with pytest.raises(DataError, match=r"smallest class size \(3\) for stratified CV, got 4"):
        make_folds(CVSpec(splitter="stratified", n_splits=4, seed=0), data)


@pytest.mark.parametrize("splitter", ["kfold", "stratified", "group", "stratified_group"])
def test_repeated_folds_validate_every_sample_once_per_repeat_and_keep_groups_whole(splitter):
    data = grouped_dataset()
    repeated = make_folds(CVSpec(splitter=splitter, n_splits=3, n_repeats=4, seed=5), data)
    assert len(repeated) == 12
    counts = np.bincount(np.concatenate([fold.val for fold in repeated.folds]), minlength=len(data.y))
    assert counts.tolist() == [4] * len(data.y)
    for fold in repeated.folds:
        assert np.intersect1d(fold.train, fold.val).size == 0
        if splitter in ("group", "stratified_group"):
            assert np.intersect1d(data.groups[fold.train], data.groups[fold.val]).size == 0
    # each repeat is a new shuffle; the first is the unrepeated split (old sweeps keep their folds)
    repeats = [tuple(tuple(fold.val) for fold in repeated.folds[r * 3 : (r + 1) * 3]) for r in range(4)]
    assert len(set(repeats)) == 4
    single = make_folds(CVSpec(splitter=splitter, n_splits=3, n_repeats=1, seed=5), data)
    assert manifest_identity(single.manifest()) == manifest_identity(repeated.manifest())[:3]


def test_the_manifest_lists_every_repeat_and_fold_in_scikit_learn_order():
    manifest = make_folds(CVSpec(splitter="stratified", n_splits=3, n_repeats=2, seed=0), dataset()).manifest()
    assert manifest["n_repeats"] == 2 and manifest["n_samples"] == 103
    assert [(f["fold"], f["repeat"], f["fold_in_repeat"]) for f in manifest["folds"]] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 0, 2),
        (3, 1, 0),
        (4, 1, 1),
        (5, 1, 2),
    ]


def grouped_dataset(n: int = 120) -> Dataset:
    rng = np.random.default_rng(3)
    return Dataset(
        name="grouped",
        x=rng.normal(size=(n, 8, 1)).astype(np.float32),
        y=(np.arange(n) % 2).astype(np.int32),
        groups=(np.arange(n) // 4).astype(np.int64),
    )


def plan_with_validation_counts(
    counts_per_fold: list[list[int]], splitter: str = "group"
) -> tuple[FoldPlan, np.ndarray]:
    """Hand-made folds whose validation sides hold the given class counts (together, every sample once)."""
    y = np.concatenate([np.repeat(np.arange(len(counts)), counts) for counts in counts_per_fold]).astype(np.int32)
    ends = np.cumsum([sum(counts) for counts in counts_per_fold])
    folds = tuple(
        Fold(train=np.setdiff1d(np.arange(len(y)), val), val=val) for val in np.split(np.arange(len(y)), ends[:-1])
    )
    return FoldPlan(
        cv=CVSpec(splitter=splitter, n_splits=len(folds), seed=0), folds=folds, dataset_fingerprint="hand-made"
    ), y


# 420 samples of each class overall; fold 0 is the unbalanced one, folds 1 and 2 stray by 0.12.
UNBALANCED = [[42, 210, 168], [189, 105, 126], [189, 105, 126]]


def test_an_unbalanced_group_fold_is_named_with_its_class_counts():
    plan, y = plan_with_validation_counts(UNBALANCED)
    assert class_balance_warning(plan, y) == (
        "cv.splitter group: fold 0 validates on class counts [42, 210, 168] (10%/50%/40%) while the data has "
        "33%/33%/33%, a total-variation distance of 0.23 (over 0.2): its score measures another class mix than "
        "the data's; cv.splitter: stratified_group keeps groups whole and each fold's classes close to the data's"
    )


def test_the_warning_counts_every_fold_past_the_threshold():
    plan, y = plan_with_validation_counts([[100, 0], [0, 100], [50, 50]])
    warning = class_balance_warning(plan, y)
    assert warning.startswith(
        "cv.splitter group: fold 0 validates on class counts [100, 0] (100%/0%) while the "
        "data has 50%/50%, a total-variation distance of 0.50 (over 0.2); 2 of 3 folds are "
        "past it: "
    )


@pytest.mark.parametrize(
    "counts_per_fold",
    [
        [[140, 140, 140]] * 3,
        [[150, 110, 160], [135, 155, 130], [135, 155, 130]],  # strays by 0.07 at most
    ],
)
def test_balanced_group_folds_get_no_warning(counts_per_fold):
    plan, y = plan_with_validation_counts(counts_per_fold)
    assert class_balance_warning(plan, y) is None


@pytest.mark.parametrize("splitter", ["kfold", "stratified", "stratified_group"])
def test_only_the_group_splitter_is_checked(splitter):
    plan, y = plan_with_validation_counts(UNBALANCED, splitter=splitter)
    assert class_balance_warning(plan, y) is None


def test_group_folds_of_one_class_groups_warn_and_mixed_groups_do_not():
    x = np.zeros((90, 4, 1), np.float32)
    y = np.repeat([0, 1, 2], 30).astype(np.int32)
    one_class_groups = Dataset(name="toy", x=x, y=y, groups=np.repeat([0, 1, 2], 30))
    plan = make_folds(CVSpec(splitter="group", n_splits=3, seed=0), one_class_groups)
    assert "a total-variation distance of 0.67 (over 0.2); 3 of 3 folds are past it" in class_balance_warning(plan, y)
    mixed_groups = Dataset(name="toy", x=x, y=y, groups=np.arange(90) % 9)
    assert class_balance_warning(make_folds(CVSpec(splitter="group", n_splits=3, seed=0), mixed_groups), y) is None


SPLIT_BESIDE = """
import json, os, signal, sys
import numpy as np
from pipeline.inputs.datasets import Dataset
from pipeline.inputs.folds import folds_beside
from pipeline.inputs.spec import CVSpec

samples, splits, then = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
data = Dataset(name="toy", x=np.zeros((samples, 8, 1), np.float32), y=(np.arange(samples) % 3).astype(np.int32))
waiting = folds_beside(CVSpec(splitter="stratified", n_splits=splits, seed=5), data)
beside = hasattr(waiting, "_child")
if then == "dies":  # killed before it reads the folds: its child must not wait for it forever
    print(json.dumps({"child": waiting._child.pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    answer = {"manifest": waiting().manifest()}
except Exception as exc:
    answer = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps({**answer, "scikit_learn_loaded": "sklearn" in sys.modules, "beside": beside}))
"""


def split_beside(samples: int, splits: int, cache: Path, then: str = "reads") -> dict:
    ran = subprocess.run(
        [sys.executable, "-c", SPLIT_BESIDE, str(samples), str(splits), then],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(cache)},
    )
    return json.loads(ran.stdout)


@pytest.mark.e2e  # a fresh command and its child
@pytest.mark.parametrize(("samples", "splits"), [(103, 3), (103, 200), (30_000, 5)])  # (30,000, 5): 1.2 MB of folds
def test_a_command_gets_from_beside_it_the_folds_or_the_refusal_it_would_make_itself(samples, splits, tmp_path):
    """A fresh command (no TensorFlow or scikit-learn loaded) splits its folds in a child process:
    the same folds, or the same refusal, as splitting in place, and never loads scikit-learn."""
    beside = split_beside(samples, splits, tmp_path)
    assert beside["scikit_learn_loaded"] is False and beside["beside"] is True
    data = Dataset(name="toy", x=np.zeros((samples, 8, 1), np.float32), y=(np.arange(samples) % 3).astype(np.int32))
    spec = CVSpec(splitter="stratified", n_splits=splits, seed=5)
    if splits < samples:
        assert beside["manifest"] == make_folds(spec, data).manifest()
    else:
        with pytest.raises(DataError) as refused:
            make_folds(spec, data)
        assert beside["error"] == f"DataError: {refused.value}"


@pytest.mark.e2e  # a fresh command and its child
def test_the_child_splitting_beside_a_command_that_dies_ends_too(tmp_path):
    """Its folds (1.2 MB) fill the pipe to a command killed before reading them: the send fails
    and the child ends, instead of waiting on the pipe for good."""
    command = subprocess.Popen(
        [sys.executable, "-c", SPLIT_BESIDE, "30000", "5", "dies"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path)},
    )
    with command:  # the child holds the command's output too: read its line, not to the end
        child = json.loads(command.stdout.readline())["child"]
        command.wait()
        deadline = time.monotonic() + 60
        while not gone(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        ended = gone(child)
        if not ended:
            os.kill(child, signal.SIGKILL)
    assert ended


@pytest.mark.e2e  # a fresh command and its child
def test_a_later_command_on_the_same_data_reads_the_folds_back_without_splitting(tmp_path):
    """The second command splits nothing (no child, no scikit-learn) and gets the same folds."""
    first = split_beside(3_000, 4, tmp_path)
    again = split_beside(3_000, 4, tmp_path)
    assert first["beside"] is True and again["beside"] is False and again["scikit_learn_loaded"] is False
    assert again["manifest"] == first["manifest"]
    assert len(list((tmp_path / "foldsweep" / "folds").glob("*.npz"))) == 1


def test_remembered_folds_come_back_with_their_splits_warnings_and_only_for_their_data_and_cv():
    data = dataset()
    cv = CVSpec(splitter="stratified", n_splits=3, seed=1)
    plan = folds_beside(cv, data)()
    assert remembered_folds(cv, data)[0].manifest() == plan.manifest() == make_folds(cv, data).manifest()
    remember_folds(plan, [("the split warned", UserWarning)])
    with pytest.warns(UserWarning, match="^the split warned$"):
        assert folds_beside(cv, data)().manifest() == plan.manifest()
    assert remembered_folds(CVSpec(splitter="stratified", n_splits=3, seed=2), data) is None
    assert remembered_folds(CVSpec(splitter="kfold", n_splits=3, seed=1), data) is None
    other = Dataset(name="toy", x=data.x + 1, y=data.y)
    assert remembered_folds(cv, other) is None


def test_folds_kept_by_other_splitting_code_are_split_again(monkeypatch, tmp_path):
    data = dataset()
    cv = CVSpec(splitter="kfold", n_splits=3, seed=0)
    folds_beside(cv, data)()
    assert remembered_folds(cv, data) is not None
    changed = tmp_path / "folds.py"
    changed.write_text(Path(folds_module.__file__).read_text() + "\n# how the splitters are called changed\n")
    monkeypatch.setattr(folds_module, "__file__", str(changed))
    assert remembered_folds(cv, data) is None


def test_the_warnings_a_split_gives_are_shown_and_shown_again_when_its_folds_are_read_back(monkeypatch):
    data = dataset()
    cv = CVSpec(splitter="kfold", n_splits=3, seed=0)
    splits = folds_module._splits

    def warning_splits(*arguments):
        warnings.warn("the splitter warned", UserWarning, stacklevel=1)
        return splits(*arguments)

    monkeypatch.setattr(folds_module, "_splits", warning_splits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # as a researcher's filter may: what is kept is every warning
        folds_beside(cv, data)()
    with pytest.warns(UserWarning, match="^the splitter warned$"):
        assert folds_beside(cv, data)().manifest() == make_folds(cv, data).manifest()


def test_a_split_that_warned_in_a_category_of_a_library_is_not_remembered():
    data = dataset()
    cv = CVSpec(splitter="kfold", n_splits=3, seed=0)

    class LibraryWarning(UserWarning):
        pass

    remember_folds(make_folds(cv, data), [("said", LibraryWarning)])  # not one of Python's own categories
    assert remembered_folds(cv, data) is None


def test_kept_folds_that_do_not_split_the_data_are_split_again(folds_cache):
    data = dataset()
    cv = CVSpec(splitter="kfold", n_splits=3, seed=0)
    plan = make_folds(cv, data)
    broken = FoldPlan(
        cv=cv,
        folds=(plan.folds[0], plan.folds[0], Fold(plan.folds[2].train, plan.folds[1].val)),
        dataset_fingerprint=data.fingerprint,
    )
    remember_folds(broken, [])
    assert remembered_folds(cv, data) is None
    remember_folds(FoldPlan(cv=cv, folds=(plan.folds[0],) * 3, dataset_fingerprint=data.fingerprint), [])
    assert remembered_folds(cv, data) is None  # each fold whole, but one sample set validated thrice
    assert folds_beside(cv, data)().manifest() == plan.manifest()
    for kept in folds_cache.glob("*.npz"):
        kept.write_bytes(b"not an npz")
    assert remembered_folds(cv, data) is None


def test_remembered_folds_stay_within_their_bound_the_least_recently_read_going_first(folds_cache, monkeypatch):
    data = dataset()
    first, second, third = (CVSpec(splitter="kfold", n_splits=3, seed=seed) for seed in range(3))
    remember_folds(make_folds(first, data), [])
    (kept,) = folds_cache.glob("*.npz")
    monkeypatch.setattr(folds_module, "FOLDS_CACHE_LIMIT_BYTES", 2 * kept.stat().st_size)
    remember_folds(make_folds(second, data), [])
    for age, path in enumerate(sorted(folds_cache.glob("*.npz"), key=lambda path: path != kept)):
        os.utime(path, (1_000_000 + age, 1_000_000 + age))  # the first written is the least recent
    assert remembered_folds(first, data) is not None  # read: now the most recent

    remember_folds(make_folds(third, data), [])

    assert remembered_folds(second, data) is None
    assert remembered_folds(first, data) is not None and remembered_folds(third, data) is not None
    assert len(list(folds_cache.glob("*.npz"))) == 2


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie waits only for its parent to read its status)."""
    try:
        return "(zombie)" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
