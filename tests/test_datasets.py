"""Built-in data is generated locally and cached; files are checked before anything runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from pipeline import datasets
from pipeline.datasets import Dataset, load_dataset
from pipeline.errors import DataError
from pipeline.spec import DatasetSpec


def test_mnist1d_is_generated_with_its_test_split_held_out():
    data = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 500}))
    assert data.x.shape == (400, 40, 1) and data.x.dtype == np.float32
    assert data.x_test.shape == (100, 40, 1)
    assert data.y.dtype == np.int32 and set(np.unique(data.y)) == set(range(10))
    assert data.n_classes == 10
    # No CV sample is a test sample.
    train_rows = {row.tobytes() for row in data.x}
    assert not any(row.tobytes() in train_rows for row in data.x_test)


def test_mnist1d_is_cached_and_deterministic(monkeypatch):
    spec = DatasetSpec(name="mnist1d", options={"num_samples": 300, "seed": 5})
    first = load_dataset(spec)
    cached = list(datasets.data_dir().glob("mnist1d-*.npz"))
    assert cached, "the generated dataset is cached under the data directory"

    def must_not_generate(options):
        raise AssertionError("a cached dataset was generated again")

    blocked = dataclasses.replace(datasets.BUILTINS["mnist1d"], generate=must_not_generate)
    monkeypatch.setitem(datasets.BUILTINS, "mnist1d", blocked)
    again = load_dataset(spec)
    assert again.fingerprint == first.fingerprint


def test_mnist1d_seed_changes_the_data():
    a = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 200, "seed": 1}))
    b = load_dataset(DatasetSpec(name="mnist1d", options={"num_samples": 200, "seed": 2}))
    assert a.fingerprint != b.fingerprint


def test_generation_leaves_numpy_global_random_state_alone():
    np.random.seed(123)
    expected = np.random.random()
    np.random.seed(123)
    datasets._generate_mnist1d({"num_samples": 100, "seed": 9, "train_split": 0.8})
    assert np.random.random() == expected


@pytest.mark.parametrize(("options", "message"), [
    ({"num_samples": 10}, "dataset.num_samples must be an integer >= 100, got 10"),
    ({"train_split": 1.5}, "dataset.train_split must be a number between 0 and 1"),
    ({"seed": -3}, "dataset.seed must be an integer >= 0, got -3"),
    ({"samples": 100}, "dataset.samples: not an option of built-in dataset 'mnist1d'"),
])
def test_bad_generator_options_are_refused(options, message):
    with pytest.raises(DataError) as caught:
        load_dataset(DatasetSpec(name="mnist1d", options=options))
    assert message in str(caught.value)


def test_unknown_builtin_is_refused():
    with pytest.raises(DataError, match="unknown built-in dataset 'mnist2d'; built-ins: digits, mnist1d, protein_windows"):
        load_dataset(DatasetSpec(name="mnist2d"))


def save(tmp_path: Path, **arrays) -> Path:
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    return path


def test_npz_file_loads_and_gains_a_channel_axis(tmp_path):
    path = save(tmp_path, x=np.ones((10, 6), np.float32), y=np.arange(10) % 2)
    data = load_dataset(DatasetSpec(path=str(path)))
    assert data.x.shape == (10, 6, 1) and data.n_classes == 2


@pytest.mark.parametrize(("arrays", "message"), [
    ({"x": np.ones((4, 3))}, "has no array 'y'"),
    ({"x": np.ones((4, 3)), "y": np.arange(5)}, "arrays x and y differ in length: 4 vs 5"),
    ({"x": np.ones((4, 3)), "y": np.array([0.0, 1.0, 0.0, 1.0])}, "array y must be 1-D integer class labels"),
    ({"x": np.array([[1.0, np.nan], [1.0, 2.0], [np.inf, 0.0]]), "y": np.arange(3)},
     "array x has 2 samples with NaN/Inf, first at index 0"),
    ({"x": np.ones((3, 2)), "y": np.array([0, -1, 1])}, "array y has negative labels"),
    ({"x": np.array(["a", "b"]), "y": np.arange(2)}, "array x must be numeric"),
])
def test_bad_npz_is_refused_with_the_reason(tmp_path, arrays, message):
    with pytest.raises(DataError) as caught:
        load_dataset(DatasetSpec(path=str(save(tmp_path, **arrays))))
    assert message in str(caught.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        load_dataset(DatasetSpec(path=str(tmp_path / "absent.npz")))


def test_fingerprint_changes_with_any_value():
    x = np.zeros((5, 3, 1), np.float32)
    y = np.arange(5, dtype=np.int32)
    base = Dataset("d", x, y).fingerprint
    changed = x.copy()
    changed[4, 2, 0] = 1e-6
    assert Dataset("d", changed, y).fingerprint != base
    assert Dataset("d", x.copy(), y.copy()).fingerprint == base
