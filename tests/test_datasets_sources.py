"""Data sources: every splitter, grouped CV without leakage, protein windows, digits, file formats."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.base.errors import DataError
from pipeline.inputs.datasets import Dataset, load_dataset
from pipeline.inputs.folds import make_folds
from pipeline.inputs.protein import AMINO_ACIDS, SEGMENT_LENGTHS, SEGMENT_SHARES
from pipeline.inputs.spec import CVSpec, DatasetSpec


def grouped_dataset(n: int = 240, n_groups: int = 24) -> Dataset:
    rng = np.random.default_rng(3)
    return Dataset(
        name="toy",
        x=rng.normal(size=(n, 6, 1)).astype(np.float32),
        y=(np.arange(n) % 3).astype(np.int32),
        groups=rng.integers(0, n_groups, size=n),
    )


@pytest.mark.parametrize("splitter", ["kfold", "stratified", "group", "stratified_group"])
def test_every_splitter_validates_each_sample_once_and_grouped_ones_never_leak(splitter):
    data = grouped_dataset()
    plan = make_folds(CVSpec(splitter=splitter, n_splits=4, seed=5), data)
    counts = np.bincount(np.concatenate([fold.val for fold in plan.folds]), minlength=len(data.y))
    assert counts.tolist() == [1] * len(data.y)
    if splitter in ("group", "stratified_group"):
        for fold in plan.folds:
            assert not set(data.groups[fold.train]) & set(data.groups[fold.val])
    again = make_folds(CVSpec(splitter=splitter, n_splits=4, seed=5), data)
    assert plan.manifest() == again.manifest()


@pytest.mark.parametrize("splitter", ["group", "stratified_group"])
def test_grouped_cv_needs_groups_and_enough_of_them(splitter):
    data = grouped_dataset()
    without = Dataset(name="toy", x=data.x, y=data.y)
    with pytest.raises(DataError, match=f"cv.splitter {splitter} needs groups, but dataset 'toy' has none"):
        make_folds(CVSpec(splitter=splitter, n_splits=3, seed=0), without)
    few = Dataset(name="toy", x=data.x, y=data.y, groups=np.arange(len(data.y)) % 3)
    with pytest.raises(DataError, match=r"cv.n_splits must be <= the number of groups \(3\), got 4"):
        make_folds(CVSpec(splitter=splitter, n_splits=4, seed=0), few)


SMALL_PROTEINS = {"n_proteins": 300, "seed": 11}


def test_protein_windows_are_deterministic_and_shaped_as_documented():
    first = load_dataset(DatasetSpec(name="protein_windows", options=SMALL_PROTEINS))
    again = load_dataset(DatasetSpec(name="protein_windows", options=SMALL_PROTEINS))
    other = load_dataset(DatasetSpec(name="protein_windows", options={**SMALL_PROTEINS, "seed": 12}))
    assert first.fingerprint == again.fingerprint != other.fingerprint
    assert first.x.shape[1:] == (15, len(AMINO_ACIDS) + 1) and first.x.dtype == np.float32
    assert np.all(first.x.sum(axis=-1) == 1.0)  # one-hot: a residue or padding at every position
    assert set(np.unique(first.y)) == {0, 1, 2}
    assert len(np.unique(first.groups)) == 240 and first.x_test is not None  # 20% of proteins held out
    assert len(first.y) == len(first.groups)
    # The centre residue of each window is a residue, never padding.
    assert np.all(first.x[:, 7, len(AMINO_ACIDS)] == 0)


def test_protein_labels_follow_the_generator_proportions():
    data = load_dataset(DatasetSpec(name="protein_windows", options=SMALL_PROTEINS))
    observed = np.bincount(data.y, minlength=3) / len(data.y)
    # The share of residues in each state the generator produces, on average.
    residues = SEGMENT_SHARES * np.array([(low + high) / 2 for low, high in SEGMENT_LENGTHS])
    np.testing.assert_allclose(observed, residues / residues.sum(), atol=0.03)


def test_protein_window_width_is_configurable_and_must_be_odd():
    data = load_dataset(DatasetSpec(name="protein_windows", options={"n_proteins": 10, "width": 9}))
    assert data.x.shape[1:] == (9, 21)
    with pytest.raises(DataError, match="dataset.width must be odd"):
        load_dataset(DatasetSpec(name="protein_windows", options={"width": 8}))


def test_digits_is_bundled_with_a_held_out_split():
    data = load_dataset(DatasetSpec(name="digits"))
    assert data.x.shape == (1437, 8, 8, 1) and data.x_test.shape == (360, 8, 8, 1)
    assert 0.0 <= data.x.min() and data.x.max() <= 1.0 and data.n_classes == 10


def test_npz_arrays_can_be_renamed_and_a_npy_directory_is_memory_mapped(tmp_path):
    x = np.random.default_rng(0).normal(size=(30, 5)).astype(np.float32)
    y = np.arange(30) % 3
    np.savez(tmp_path / "renamed.npz", features=x, labels=y, protein=np.arange(30) // 5)
    data = load_dataset(
        DatasetSpec(path=str(tmp_path / "renamed.npz"), options={"x": "features", "y": "labels", "groups": "protein"})
    )
    assert data.x.shape == (30, 5, 1) and data.groups.tolist() == (np.arange(30) // 5).tolist()
    directory = tmp_path / "arrays"
    directory.mkdir()
    np.save(directory / "x.npy", x)
    np.save(directory / "y.npy", y)
    mapped = load_dataset(DatasetSpec(path=str(directory)))
    assert isinstance(mapped.x.base, np.memmap) or isinstance(mapped.x, np.memmap)
    np.testing.assert_array_equal(np.asarray(mapped.x)[..., 0], x)


@pytest.mark.parametrize(
    ("arrays", "options", "message"),
    [
        ({"x": np.ones((4, 3)), "y": np.arange(4)}, {"y": "labels"}, "has no array 'labels' (for y)"),
        (
            {"x": np.array([np.ones(3), np.ones(2)], dtype=object), "y": np.arange(2)},
            {},
            "holds an object array (ragged shapes?)",
        ),
        (
            {"x": np.ones((4, 3)), "y": np.array([0.0, 1.0, 0.0, 1.0])},
            {},
            "array y must be 1-D integer class labels, got dtype float64",
        ),
        (
            {"x": np.ones((4, 3)), "y": np.arange(4), "groups": np.arange(3)},
            {},
            "arrays groups and y differ in length: 3 vs 4",
        ),
        ({"x": np.ones((4, 3)), "y": np.arange(4)}, {"weights": "w"}, "dataset.weights: not an option of a data file"),
    ],
)
def test_file_format_errors_name_the_array_and_the_problem(tmp_path, arrays, options, message):
    np.savez(tmp_path / "data.npz", **arrays)
    with pytest.raises(DataError) as caught:
        load_dataset(DatasetSpec(path=str(tmp_path / "data.npz"), options=options))
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("arrays", "options", "message"),
    [
        (
            {"X": np.ones((4, 3)), "Y": np.arange(4)},
            {},
            "has no array 'x' (for x) nor 'y' (for y); its arrays are X, Y: name the ones to use in the spec, "
            "e.g. dataset: {path: PATH, x: X, y: Y}",
        ),
        (
            {"features": np.ones((4, 3)), "labels": np.arange(4), "protein": np.arange(4)},
            {"groups": "protein"},
            "has no array 'x' (for x) nor 'y' (for y); its arrays are features, labels, protein: name the ones to use "
            "in the spec, e.g. dataset: {path: PATH, x: features, y: labels, groups: protein}",
        ),
        (
            {"X": np.ones((4, 3)), "Y": np.arange(4), "X_test": np.ones((2, 3)), "Y_test": np.arange(2)},
            {},
            "has no array 'x' (for x) nor 'y' (for y); its arrays are X, Y, X_test, Y_test: name the ones to use in the "
            "spec, e.g. dataset: {path: PATH, x: X, y: Y, x_test: X_test, y_test: Y_test}",
        ),
        (
            {"signals": np.ones((4, 3)), "y": np.arange(4)},
            {},
            "has no array 'x' (for x); its arrays are signals, y: name the ones to use in the spec, "
            "e.g. dataset: {path: PATH, x: signals}",
        ),
        (
            {"a": np.ones((4, 3)), "b": np.arange(4)},
            {},
            "has no array 'x' (for x) nor 'y' (for y); its arrays are a, b: name the ones to use in the spec, "
            "e.g. dataset: {path: PATH, x: <its name in the file>, y: <its name in the file>}",
        ),
        (
            {"x": np.ones((4, 3)), "y": np.arange(4)},
            {"groups": "protein"},
            "has no array 'protein' (for groups); its arrays are x, y: name the ones to use in the spec, "
            "e.g. dataset: {path: PATH, groups: <its name in the file>}",
        ),
    ],
)
def test_a_file_without_the_named_arrays_lists_its_arrays_and_the_renaming(tmp_path, arrays, options, message):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError) as caught:
        load_dataset(DatasetSpec(path=str(path), options=options))
    assert str(caught.value) == f"dataset: {str(path)!r} {message.replace('PATH', str(path))}"


def test_a_npy_directory_without_x_and_y_lists_its_files(tmp_path):
    np.save(tmp_path / "X.npy", np.ones((4, 3)))
    np.save(tmp_path / "Y.npy", np.arange(4))
    with pytest.raises(DataError) as caught:
        load_dataset(DatasetSpec(path=str(tmp_path)))
    assert str(caught.value) == (
        f"dataset: {str(tmp_path)!r} has no array 'x' (for x) nor 'y' (for y); its arrays are X, Y: name the ones "
        f"to use in the spec, e.g. dataset: {{path: {tmp_path}, x: X, y: Y}}"
    )
    renamed = load_dataset(DatasetSpec(path=str(tmp_path), options={"x": "X", "y": "Y"}))
    assert renamed.x.shape == (4, 3, 1)
