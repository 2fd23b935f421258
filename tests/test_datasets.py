"""Built-in data is generated locally and cached; files are checked before anything runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from helpers import write_image_folder

from pipeline.base.errors import DataError
from pipeline.inputs import datasets, mnist1d
from pipeline.inputs.datasets import Dataset, load_dataset
from pipeline.inputs.spec import DatasetSpec


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


@pytest.mark.parametrize(("num_samples", "seed", "train_split"), [(1000, 42, 0.8), (347, 7, 0.6)])
def test_mnist1d_is_the_packages_dataset_bit_for_bit(num_samples, seed, train_split):
    import random

    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed, args.train_split = num_samples, seed, train_split
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        expected = make_dataset(args)
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    made = mnist1d.make_dataset(num_samples, seed, train_split)
    for key in ("x", "y", "x_test", "y_test"):
        assert made[key].dtype == expected[key].dtype, key
        np.testing.assert_array_equal(made[key], expected[key], strict=True, err_msg=key)


def test_mnist1d_templates_and_arguments_are_the_packages():
    from mnist1d.data import get_dataset_args, get_templates

    np.testing.assert_array_equal(mnist1d.templates(), get_templates()["x"], strict=True)
    args = get_dataset_args(as_dict=True)
    ours = {
        "template_len": mnist1d.TEMPLATE_LEN,
        "padding": list(mnist1d.PADDING),
        "scale_coeff": mnist1d.SCALE_COEFF,
        "max_translation": mnist1d.MAX_TRANSLATION,
        "corr_noise_scale": mnist1d.CORR_NOISE_SCALE,
        "iid_noise_scale": mnist1d.IID_NOISE_SCALE,
        "shear_scale": mnist1d.SHEAR_SCALE,
        "final_seq_length": mnist1d.FINAL_SEQ_LENGTH,
        "shuffle_seq": False,
    }
    assert {key: args[key] for key in ours} == ours
    defaults = datasets.BUILTINS["mnist1d"].defaults
    assert {key: args[key] for key in defaults} == dict(defaults)


def test_generation_leaves_numpy_global_random_state_alone():
    np.random.seed(123)
    expected = np.random.random()
    np.random.seed(123)
    datasets._generate_mnist1d({"num_samples": 100, "seed": 9, "train_split": 0.8})
    assert np.random.random() == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_samples": 10}, "dataset.num_samples must be an integer >= 100, got 10"),
        ({"train_split": 1.5}, "dataset.train_split must be a number between 0 and 1"),
        ({"seed": -3}, "dataset.seed must be an integer from 0 to 4294967295, got -3"),
        ({"seed": 2**32}, "dataset.seed must be an integer from 0 to 4294967295, got 4294967296"),
        ({"samples": 100}, "dataset.samples: not an option of built-in dataset 'mnist1d'"),
    ],
)
def test_bad_generator_options_are_refused(options, message):
    with pytest.raises(DataError) as caught:
        load_dataset(DatasetSpec(name="mnist1d", options=options))
    assert message in str(caught.value)


def test_a_seed_scikit_learn_cannot_take_is_refused_for_the_digits_split():
    with pytest.raises(DataError, match="dataset.seed must be an integer from 0 to 4294967295, got 4294967296"):
        load_dataset(DatasetSpec(name="digits", options={"seed": 2**32}))


def test_unknown_builtin_is_refused():
    with pytest.raises(
        DataError, match="unknown built-in dataset 'mnist2d'; built-ins: digits, mnist1d, protein_windows"
    ):
        load_dataset(DatasetSpec(name="mnist2d"))


def save(tmp_path: Path, **arrays) -> Path:
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    return path


def test_npz_file_loads_and_gains_a_channel_axis(tmp_path):
    path = save(tmp_path, x=np.ones((10, 6), np.float32), y=np.arange(10) % 2)
    data = load_dataset(DatasetSpec(path=str(path)))
    assert data.x.shape == (10, 6, 1) and data.n_classes == 2


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.ones((4, 3))}, "has no array 'y'"),
        ({"x": np.ones((4, 3)), "y": np.arange(5)}, "arrays x and y differ in length: 4 vs 5"),
        ({"x": np.ones((4, 3)), "y": np.array([0.0, 1.0, 0.0, 1.0])}, "array y must be 1-D integer class labels"),
        (
            {"x": np.array([[1.0, np.nan], [1.0, 2.0], [np.inf, 0.0]]), "y": np.arange(3)},
            "array x has 2 samples with NaN/Inf, first at index 0",
        ),
        ({"x": np.ones((3, 2)), "y": np.array([0, -1, 1])}, "array y has negative labels"),
        ({"x": np.array(["a", "b"]), "y": np.arange(2)}, "array x must be numeric"),
    ],
)
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


def package_in(tmp_path: Path, *, checkout: bool, data_folder: bool = True) -> Path:
    """Where the package would sit: a checkout (pyproject.toml beside it, maybe a data/ folder)
    or an installed copy in site-packages."""
    project = tmp_path / ("checkout" if checkout else "site-packages")
    (project / "pipeline").mkdir(parents=True)
    if checkout:
        (project / "pyproject.toml").write_text("[project]\nname = 'foldsweep'\n")
        if data_folder:
            (project / "data").mkdir()
    return project / "pipeline"


@pytest.fixture
def no_data_dir_variable(monkeypatch, tmp_path):
    """FOLDSWEEP_DATA_DIR unset, and a home and cache of the test's own, so nothing lands in the real ones."""
    monkeypatch.delenv(datasets.DATA_DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_the_data_dir_variable_wins_over_a_checkout(monkeypatch, tmp_path):
    monkeypatch.setattr(datasets, "PACKAGE_DIR", package_in(tmp_path, checkout=True))
    monkeypatch.setenv(datasets.DATA_DIR_ENV, str(tmp_path / "elsewhere"))
    assert datasets.data_dir() == tmp_path / "elsewhere"
    assert datasets.data_dir_source() == f"$FOLDSWEEP_DATA_DIR ({tmp_path / 'elsewhere'})"
    # A relative value means relative to where it was set, made absolute at once.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(datasets.DATA_DIR_ENV, "cache")
    assert datasets.data_dir() == tmp_path / "cache"


def test_a_checkout_caches_in_its_own_data_folder_from_any_working_directory(
    monkeypatch, tmp_path, no_data_dir_variable
):
    monkeypatch.setattr(datasets, "PACKAGE_DIR", package_in(tmp_path, checkout=True))
    monkeypatch.chdir(tmp_path / "checkout" / "pipeline")
    assert datasets.data_dir() == tmp_path / "checkout" / "data"
    assert datasets.data_dir_source() == (
        f"the project's data/ folder ({tmp_path / 'checkout' / 'data'}), as foldsweep runs from its checkout; "
        "$FOLDSWEEP_DATA_DIR moves it"
    )


@pytest.mark.parametrize(
    ("checkout", "xdg_cache_home", "cache"),
    [
        (False, None, "home/.cache/foldsweep"),
        (False, "", "home/.cache/foldsweep"),
        (False, "relative/cache", "home/.cache/foldsweep"),  # the XDG spec ignores relative paths
        (False, "xdg", "xdg/foldsweep"),
        (True, None, "home/.cache/foldsweep"),  # a checkout without data/ is not foldsweep's own
    ],
)
def test_an_installed_package_caches_in_the_user_cache_directory(
    monkeypatch, tmp_path, no_data_dir_variable, checkout, xdg_cache_home, cache
):
    monkeypatch.setattr(datasets, "PACKAGE_DIR", package_in(tmp_path, checkout=checkout, data_folder=False))
    if xdg_cache_home is not None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg") if xdg_cache_home == "xdg" else xdg_cache_home)
    assert datasets.data_dir() == tmp_path / cache
    named = "$XDG_CACHE_HOME/foldsweep" if xdg_cache_home == "xdg" else "~/.cache/foldsweep"
    assert datasets.data_dir_source() == (
        f"the user cache directory {named} ({tmp_path / cache}), as foldsweep is not installed from a checkout; "
        "$FOLDSWEEP_DATA_DIR moves it"
    )


@pytest.mark.parametrize(("checkout", "cache"), [(True, "checkout/data"), (False, "xdg/foldsweep")])
def test_loading_a_builtin_writes_nothing_into_the_working_directory(
    monkeypatch, tmp_path, no_data_dir_variable, checkout, cache
):
    monkeypatch.setattr(datasets, "PACKAGE_DIR", package_in(tmp_path, checkout=checkout))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.chdir(scratch)
    load_dataset(DatasetSpec(name="digits", options={"seed": 3}))
    assert list(scratch.iterdir()) == []
    assert [path.name.split("-")[0] for path in (tmp_path / cache).iterdir()] == ["digits"]


def labels_file(tmp_path: Path, y, y_test=None) -> Path:
    arrays = {"x": np.ones((len(y), 3), np.float32), "y": np.asarray(y)}
    if y_test is not None:
        arrays.update(x_test=np.ones((len(y_test), 3), np.float32), y_test=np.asarray(y_test))
    return save(tmp_path, **arrays)


def test_one_hot_rows_load_as_class_indices_marked_one_hot_and_other_rows_as_they_are(tmp_path):
    rows = np.eye(3, dtype=np.float32)[[0, 2, 1, 2]]
    dataset = load_dataset(DatasetSpec(path=str(labels_file(tmp_path, rows, rows[:2]))))
    assert dataset.y.tolist() == [0, 2, 1, 2] and dataset.y_test.tolist() == [0, 2]
    assert dataset.y.dtype == np.int32 and dataset.one_hot_classes == 3 and dataset.n_classes == 3
    (tmp_path / "other").mkdir()
    indices = load_dataset(DatasetSpec(path=str(labels_file(tmp_path / "other", [0, 2, 1, 2], [0, 2]))))
    assert not indices.one_hot and indices.fingerprint != dataset.fingerprint
    # Not one-hot: integer rows with two 1s (labels per position), probabilities (regression targets).
    for y in (np.array([[1, 1], [0, 1]], np.int32), np.full((2, 2), 0.5, np.float32)):
        kept = load_dataset(DatasetSpec(path=str(labels_file(tmp_path / "other", y))))
        assert not kept.one_hot and np.array_equal(kept.y, y)
    wider = datasets.as_class_indices(Dataset("d", np.ones((2, 3)), rows[:2], np.ones((2, 3)), np.eye(4)[:2]))
    assert not wider.one_hot


def test_float_targets_that_are_not_whole_numbers_are_regression_targets(tmp_path):
    from pipeline.inputs.scoring import is_regression

    path = labels_file(tmp_path, [0.5, 1.25, -2.0, 1.0], None)
    dataset = load_dataset(DatasetSpec(path=str(path)))
    assert is_regression(dataset.y) and dataset.n_classes == 0
    assert dataset.y.tolist() == [0.5, 1.25, -2.0, 1.0]  # negative targets too: no class numbering rule


@pytest.mark.parametrize(
    ("y", "y_test", "message"),
    [
        (
            [0.0, 1.0, 2.0, 1.0],
            None,
            "array y must be 1-D integer class labels, got dtype float64 shape (4,); its values are whole numbers (0 to 2): "
            "store them as integers, y.astype(int) in code, np.savez(..., y=y.astype(np.int64)) in the file",
        ),
        (
            [0, 1, 2, 1],
            [0.0, 2.0],
            "array y_test must be 1-D integer class labels, got dtype float64 shape (2,); its values are whole numbers "
            "(0 to 2): store them as integers, y_test.astype(int) in code, "
            "np.savez(..., y_test=y_test.astype(np.int64)) in the file",
        ),
        ([0.0, np.nan, 1.0], None, "array y has 1 samples with NaN/Inf targets, first at index 1"),
        (
            [1, 2, 3, 2],
            None,
            "array y: labels must start at 0 (a model with C outputs predicts classes 0..C-1), got labels 1..3 with no 0; "
            "they look counted from 1: shift them, y - 1 (np.savez(..., y=y - 1))",
        ),
        (
            [3, 7, 7, 3],
            None,
            "array y: labels must start at 0 (a model with C outputs predicts classes 0..C-1), got labels 3, 7 with no 0; "
            "number the classes 0..C-1: classes = np.unique(y), then y = np.searchsorted(classes, y) "
            "(the same classes for y and y_test)",
        ),
        (
            [0, 1, 2, 1],
            [1, 2, 3],
            "array y_test: labels must start at 0 like y's (labels 0..2), got labels 1..3 with no 0; "
            "shift them, y_test - 1 (np.savez(..., y_test=y_test - 1))",
        ),
        (
            ["cat", "dog", "cat"],
            None,
            "array y must be 1-D integer class labels, got dtype <U3 shape (3,): number the classes 0..C-1: "
            "classes = np.unique(y), then y = np.searchsorted(classes, y) (the same classes for y and y_test)",
        ),
        (
            [[0], [1], [1]],
            None,
            "array y must be 1-D integer class labels, got dtype int64 shape (3, 1): one label per sample, flattened: "
            "y.ravel()",
        ),
        (
            [[1.0, 0.0], [1.0, 1.0]],
            None,
            "array y must be 1-D integer class labels, got dtype float64 shape (2, 2): one-hot rows (each one 1, "
            "0 elsewhere) load as they are; these are not, so store one class number per sample",
        ),
    ],
)
def test_label_mistakes_are_refused_with_a_hint(tmp_path, y, y_test, message):
    path = labels_file(tmp_path, y, y_test)
    with pytest.raises(DataError) as caught:
        load_dataset(DatasetSpec(path=str(path)))
    assert str(caught.value) == f"dataset: {path} {message}"


@pytest.mark.parametrize(
    ("y", "y_test"),
    [
        ([1, 1, 1], None),  # one class: the sweep refuses it with its own message, not "start at 0"
        ([0, 1, 2, 1], [1, 2]),  # a small test split may lack class 0 by chance
    ],
)
def test_labels_without_a_0_that_are_not_counted_from_1_load(tmp_path, y, y_test):
    load_dataset(DatasetSpec(path=str(labels_file(tmp_path, y, y_test))))


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (
            {"x": np.zeros((0, 3), np.float32), "y": np.zeros(0)},
            "has no samples: arrays x and y have length 0, shapes (0, 3) and (0,)",
        ),
        (
            {"x": np.ones((2, 3)), "y": np.arange(2), "x_test": np.zeros((0, 3)), "y_test": np.zeros(0, np.int64)},
            "has no test samples (leave x_test and y_test out when there are none): arrays x_test and y_test have "
            "length 0, shapes (0, 3) and (0,)",
        ),
    ],
)
def test_a_file_without_samples_is_refused(tmp_path, arrays, message):
    path = save(tmp_path, **arrays)
    with pytest.raises(DataError) as caught:
        load_dataset(DatasetSpec(path=str(path)))
    assert str(caught.value) == f"dataset: {path} {message}"


def test_shapes_are_ten_classes_of_rgb_images_with_a_held_out_test_split():
    data = load_dataset(DatasetSpec(name="shapes", options={"num_samples": 500}))
    assert data.x.shape == (400, 32, 32, 3) and data.x_test.shape == (100, 32, 32, 3)
    assert data.x.dtype == np.float32 and 0.0 <= data.x.min() and data.x.max() <= 255.0
    assert set(np.unique(data.y)) == set(range(10)) and data.n_classes == 10
    # Shape, not colour: a class's mean image is no brighter than another's beyond noise.
    means = [data.x[data.y == label].mean() for label in range(10)]
    assert max(means) - min(means) < 40.0
    again = load_dataset(DatasetSpec(name="shapes", options={"num_samples": 500}))
    assert again.fingerprint == data.fingerprint


@pytest.fixture(scope="module")
def shapes():
    return load_dataset(DatasetSpec(name="shapes", options={"num_samples": 300}))


def test_an_image_folder_loads_as_keras_lays_it_out_and_is_decoded_once(tmp_path, monkeypatch, shapes):
    names = ["zebra", "apple", "mango", "kiwi", "fig", "date", "lime", "pear", "plum", "yuzu"]
    write_image_folder(tmp_path / "photos" / "train", shapes.x[:120], shapes.y[:120], names)
    write_image_folder(tmp_path / "photos" / "test", shapes.x_test[:30], shapes.y_test[:30], names)
    spec = DatasetSpec(path=str(tmp_path / "photos"), images=True, options={"color_mode": "rgb"})
    data = load_dataset(spec)
    assert data.class_names == tuple(sorted(names))  # Keras' order: the folders' names sorted
    assert data.x.shape == (120, 32, 32, 3) and data.x_test.shape == (30, 32, 32, 3) and data.x.dtype == np.float32
    # Every image decoded to its pixels, labelled by its folder's place in that order.
    order = sorted(range(120), key=lambda i: (sorted(names).index(names[shapes.y[i]]), i))
    np.testing.assert_array_equal(data.x, shapes.x[order].round())
    np.testing.assert_array_equal(data.y, [sorted(names).index(names[shapes.y[i]]) for i in order])
    grey = load_dataset(DatasetSpec(path=spec.path, images=True, options={"color_mode": "grayscale"}))
    assert grey.x.shape == (120, 32, 32, 1)
    import keras  # grey as Keras decodes colour images to it, each pixel to the level

    theirs = keras.utils.image_dataset_from_directory(
        tmp_path / "photos" / "train", color_mode="grayscale", image_size=(32, 32), shuffle=False, batch_size=None
    )
    np.testing.assert_array_equal(grey.x, np.stack([image.numpy() for image, _ in theirs]))

    import PIL.Image

    def must_not_decode(*args, **kwargs):
        raise AssertionError("an image was decoded again")

    monkeypatch.setattr(PIL.Image, "open", must_not_decode)
    cached = load_dataset(spec)
    assert isinstance(cached.x, np.memmap) and cached.fingerprint == data.fingerprint


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        ("corrupt", "dataset.images: cannot decode image '{root}/class_3/broken.png': UnidentifiedImageError"),
        ("odd size", "dataset.images: image '{root}/class_3/small.png' is 20x24 (height x width), not 32x32"),
        ("empty class", "dataset.images: class folder '{root}/class_9' has no image files"),
        ("no classes", "dataset.images: '{root}/class_0' has no class subfolders"),
        ("no folder", "dataset.images: folder not found: '{root}/absent'"),
    ],
)
def test_image_folder_mistakes_are_refused_by_name(tmp_path, shapes, mistake, message):
    from PIL import Image

    root = write_image_folder(tmp_path / "images", shapes.x[:40], shapes.y[:40])
    if mistake == "corrupt":
        (root / "class_3" / "broken.png").write_bytes(b"\x89PNG half a file")
    elif mistake == "odd size":
        Image.new("RGB", (24, 20)).save(root / "class_3" / "small.png")
    elif mistake == "empty class":
        (root / "class_9").mkdir(exist_ok=True)
        for file in (root / "class_9").iterdir():
            file.unlink()
    elif mistake == "no classes":
        root = root / "class_0"
    elif mistake == "no folder":
        root = tmp_path / "images" / "absent"
    with pytest.raises(DataError) as caught:
        load_dataset(DatasetSpec(path=str(root), images=True, options={}))
    assert str(caught.value).startswith(message.format(root=tmp_path / "images"))
    assert not list(datasets.data_dir().glob(".images-*"))  # nothing half written
