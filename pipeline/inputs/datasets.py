"""Datasets: built-in generators and user files -> one ``Dataset`` with a content fingerprint.

Nothing here splits data: cross-validation runs on ``x``/``y`` (the CV training split), and
``x_test``/``y_test`` stay held out for scoring a refit model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.base.environment import cache_directory, cache_directory_name
from pipeline.base.errors import DataError
from pipeline.inputs.scoring import is_regression
from pipeline.inputs.spec import LARGEST_LEGACY_SEED, DatasetSpec

DATA_DIR_ENV = "FOLDSWEEP_DATA_DIR"


@dataclass(frozen=True)
class Dataset:
    """Arrays for one sweep. ``x`` has a channel axis (samples, steps, channels) for CNNs."""

    name: str
    x: np.ndarray
    y: np.ndarray
    x_test: np.ndarray | None = None
    y_test: np.ndarray | None = None
    groups: np.ndarray | None = None
    class_names: tuple[str, ...] | None = None  # an image folder's classes, label by label
    # The width of the one-hot rows the labels were stored as (``as_class_indices``), held here as
    # their class indices: the loss and the metrics get one-hot rows back, as fit gives them the
    # rows; 0 for labels stored as indices.
    one_hot_classes: int = 0

    @property
    def one_hot(self) -> bool:
        return self.one_hot_classes > 0

    @classmethod
    def of_arrays(cls, name: str, arrays: Mapping[str, np.ndarray]) -> Dataset:
        """A dataset of the arrays found by role (x, y, x_test, y_test, groups)."""
        found = {role: arrays.get(role) for role in ARRAY_ROLES}
        x, y = found["x"], found["y"]
        assert x is not None and y is not None  # the loaders refuse data without them first
        return cls(name, x, y, x_test=found["x_test"], y_test=found["y_test"], groups=found["groups"])

    @property
    def n_classes(self) -> int:
        """The number of classes (0 for float, regression, targets)."""
        return 0 if is_regression(self.y) else int(self.y.max()) + 1

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @functools.cached_property
    def fingerprint(self) -> str:
        """Hashes every array (and whether the labels were one-hot): computed once per dataset (the
        arrays are never changed)."""
        marks = {"one_hot_classes": np.array([self.one_hot_classes])} if self.one_hot else {}
        return fingerprint_arrays({**self.arrays(), **marks})

    def arrays(self) -> dict[str, np.ndarray]:
        named = {"x": self.x, "y": self.y, "x_test": self.x_test, "y_test": self.y_test, "groups": self.groups}
        return {key: value for key, value in named.items() if value is not None}


def fingerprint_arrays(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over names, dtypes, shapes and bytes: equal fingerprints mean equal data."""
    digest = hashlib.sha256()
    for key in sorted(arrays):
        array = np.ascontiguousarray(arrays[key])
        digest.update(f"{key}:{array.dtype.str}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


# The package's folder (pipeline/, above this layer's): in a checkout (an editable install) the
# project sits right above it.
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def data_dir() -> Path:
    """The directory built-in datasets are cached in (absolute), whatever the working directory:
    ``$FOLDSWEEP_DATA_DIR`` if set; else the project's ``data/`` folder when foldsweep runs from
    its checkout; else the user's cache directory (``$XDG_CACHE_HOME/foldsweep``, else
    ``~/.cache/foldsweep``). ``data_dir_source`` says which, for people."""
    return _data_location()[0]


def data_dir_source() -> str:
    """Where built-in datasets are cached and why, as a phrase: e.g. "the project's data/ folder
    (/abs/path), as foldsweep runs from its checkout; $FOLDSWEEP_DATA_DIR moves it"."""
    path, what, why = _data_location()
    return f"{what} ({path}){why}"


def _data_location() -> tuple[Path, str, str]:
    # Never the working directory: a sweep started in a scratch directory would leave 120 MB of
    # caches behind there, and the next one, started elsewhere, would generate them again.
    moves_it = f"; ${DATA_DIR_ENV} moves it"
    configured = os.environ.get(DATA_DIR_ENV, "")
    if configured:
        return Path(configured).expanduser().absolute(), f"${DATA_DIR_ENV}", ""
    project = PACKAGE_DIR.parent
    if (project / "pyproject.toml").is_file() and (project / "data").is_dir():
        return project / "data", "the project's data/ folder", f", as foldsweep runs from its checkout{moves_it}"
    not_a_checkout = f", as foldsweep is not installed from a checkout{moves_it}"
    return cache_directory(), f"the user cache directory {cache_directory_name()}", not_a_checkout


def load_dataset(spec: DatasetSpec) -> Dataset:
    """Load the dataset a spec names (a file path as given: ``SweepSpec.resolved_dataset``
    resolves one relative to the spec).

    Raises:
        DataError: unknown built-in, bad generator options, missing or malformed file.
    """
    if spec.name is not None:
        builtin = BUILTINS.get(spec.name)
        if builtin is None:
            raise DataError(
                f"dataset: unknown built-in dataset {spec.name!r}; built-ins: {', '.join(sorted(BUILTINS))} "
                "(a data file is a .npz archive or a directory of .npy files)"
            )
        return builtin.load(spec.options)
    assert spec.path is not None  # a dataset is a name or a path: the spec's rule
    if spec.images:
        return _load_image_folder(Path(spec.path), spec.options)
    return _load_file(Path(spec.path), spec.options)


def is_one_hot(y: np.ndarray) -> bool:
    """Whether labels are one-hot rows: (samples, classes >= 2), each row one 1 and 0 elsewhere."""
    if y.ndim != 2 or y.shape[1] < 2 or not len(y) or y.dtype.kind not in "fiub":
        return False
    return bool(np.isin(y, (0, 1)).all() and (y.sum(axis=1) == 1).all())


def as_class_indices(dataset: Dataset) -> Dataset:
    """A dataset whose labels are one-hot rows (what ``keras.utils.to_categorical`` and
    ``image_dataset_from_directory(label_mode="categorical")`` give) with them held as class
    indices and marked ``one_hot``, so that folds stratify by class and a compiled
    categorical_crossentropy trains on the rows it was given; else the dataset itself."""
    splits = [y for y in (dataset.y, dataset.y_test) if y is not None]
    if not all(is_one_hot(y) and y.shape[1] == dataset.y.shape[1] for y in splits):
        return dataset

    def indices(y: np.ndarray) -> np.ndarray:
        return y.argmax(axis=1).astype(np.int32)

    y_test = None if dataset.y_test is None else indices(dataset.y_test)
    return replace(dataset, y=indices(dataset.y), y_test=y_test, one_hot_classes=dataset.y.shape[1])


def _load_image_folder(folder: Path, options: Mapping[str, Any]) -> Dataset:
    """A folder of class subfolders of image files (``pipeline.inputs.images``), decoded once and
    cached under the data directory."""
    from pipeline.inputs.images import read_image_folder

    arrays = read_image_folder(folder, options, cache_root=data_dir())
    dataset = Dataset(name=folder.name, **arrays)
    check_arrays(dataset, source=str(folder))
    return dataset


@dataclass(frozen=True)
class Builtin:
    """A dataset generated locally from options, cached under the data directory."""

    name: str
    defaults: Mapping[str, Any]
    generate: Callable[[Mapping[str, Any]], dict[str, np.ndarray]]
    validate: Callable[[Mapping[str, Any]], None]

    def load(self, options: Mapping[str, Any]) -> Dataset:
        for key in options:
            if key not in self.defaults:
                raise DataError(
                    f"dataset.{key}: not an option of built-in dataset {self.name!r}, got {options[key]!r}; "
                    f"options: {', '.join(self.defaults)}"
                )
        resolved = {**self.defaults, **options}
        self.validate(resolved)
        cache = data_dir() / f"{self.name}-{_options_key(resolved)}.npz"
        arrays = _read_cache(cache)
        if arrays is None:
            arrays = self.generate(resolved)
            _write_cache(cache, arrays)
        dataset = Dataset.of_arrays(self.name, arrays)
        check_arrays(dataset, source=f"built-in {self.name!r}")
        return dataset


def _options_key(options: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:12]


def _read_cache(path: Path) -> dict[str, np.ndarray] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as stored:
            return {key: stored[key] for key in stored.files}
    except (OSError, ValueError):
        return None  # a damaged cache is regenerated, not trusted


def _write_cache(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    # Written to a temporary file and renamed so that concurrent sweeps never read half a file.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
    except OSError as exc:
        raise DataError(
            f"dataset: built-in datasets are cached in {data_dir_source()}, but no file can be written "
            f"there ({exc.strerror or exc}: {exc.filename}); set ${DATA_DIR_ENV} to a writable "
            "directory"
        ) from None
    try:
        with os.fdopen(handle, "wb") as out:
            np.savez(out, allow_pickle=True, **arrays)  # numpy's default, given: no array is named allow_pickle
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _validate_mnist1d(options: Mapping[str, Any]) -> None:
    num_samples = options["num_samples"]
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 100:
        raise DataError(f"dataset.num_samples must be an integer >= 100, got {num_samples!r}")
    _check_legacy_seed(options["seed"])
    split = options["train_split"]
    if isinstance(split, bool) or not isinstance(split, (int, float)) or not 0 < split < 1:
        raise DataError(f"dataset.train_split must be a number between 0 and 1 (exclusive), got {split!r}")


def _generate_mnist1d(options: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """MNIST-1D made from its templates as the mnist1d package makes it (no download)."""
    from pipeline.inputs import mnist1d

    generated = mnist1d.make_dataset(options["num_samples"], options["seed"], options["train_split"])
    return {
        "x": generated["x"].astype(np.float32)[..., None],
        "y": generated["y"].astype(np.int32),
        "x_test": generated["x_test"].astype(np.float32)[..., None],
        "y_test": generated["y_test"].astype(np.int32),
    }


def _validate_digits(options: Mapping[str, Any]) -> None:
    split = options["test_fraction"]
    if isinstance(split, bool) or not isinstance(split, (int, float)) or not 0 < split < 1:
        raise DataError(f"dataset.test_fraction must be a number between 0 and 1 (exclusive), got {split!r}")
    _check_legacy_seed(options["seed"])


def _check_legacy_seed(seed: Any) -> None:
    """A seed NumPy's legacy ``RandomState`` takes: MNIST-1D's draws and the digits' split are
    made with one."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= LARGEST_LEGACY_SEED:
        raise DataError(f"dataset.seed must be an integer from 0 to {LARGEST_LEGACY_SEED}, got {seed!r}")


def _generate_digits(options: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (no download), scaled to [0, 1], with a seeded,
    stratified held-out test split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    x, x_test, y, y_test = train_test_split(
        x, y, test_size=options["test_fraction"], stratify=y, random_state=options["seed"]
    )
    return {"x": x, "y": y, "x_test": x_test, "y_test": y_test}


def _shapes_builtin() -> Builtin:
    from pipeline.inputs import shapes

    return Builtin(name="shapes", defaults=shapes.DEFAULTS, generate=shapes.generate, validate=shapes.validate)


def _protein_builtin() -> Builtin:
    from pipeline.inputs import protein

    return Builtin(
        name="protein_windows", defaults=protein.DEFAULTS, generate=protein.generate, validate=protein.validate
    )


BUILTINS: dict[str, Builtin] = {
    "mnist1d": Builtin(
        name="mnist1d",
        defaults={"num_samples": 5000, "seed": 42, "train_split": 0.8},
        generate=_generate_mnist1d,
        validate=_validate_mnist1d,
    ),
    "digits": Builtin(
        name="digits",
        defaults={"test_fraction": 0.2, "seed": 0},
        generate=_generate_digits,
        validate=_validate_digits,
    ),
    "protein_windows": _protein_builtin(),
    "shapes": _shapes_builtin(),
}

BUILTIN_DESCRIPTIONS: Mapping[str, str] = {
    "mnist1d": "MNIST-1D signals (40 steps, 10 classes), made from its templates as the mnist1d package makes them",
    "digits": "scikit-learn's bundled 8x8 handwritten digits (10 classes), for 2D CNNs",
    "shapes": "32x32 RGB images of 10 shapes (disk, ring, square...) at random places, sizes and colours, "
    "for image CNNs",
    "protein_windows": "sliding windows over synthetic proteins (one-hot residues, helix/strand/coil), "
    "groups = protein id; segments drawn with Chou-Fasman propensities",
}


def builtin_summaries() -> list[dict[str, str]]:
    """Each built-in dataset with its default options, as ``foldsweep datasets`` lists it: its
    CV and test samples, sample shape, classes, groups and what it is (generating any not yet
    cached)."""
    rows = []
    for name in BUILTINS:
        data = load_dataset(DatasetSpec(name=name))
        rows.append(
            {
                "name": name,
                "CV samples": str(len(data.y)),
                "test samples": str(len(data.y_test)) if data.y_test is not None else "-",
                "sample shape": str(data.input_shape),
                "classes": str(data.n_classes),
                "groups": str(len(set(data.groups.tolist()))) if data.groups is not None else "-",
                "what": BUILTIN_DESCRIPTIONS.get(name, ""),
            }
        )
    return rows


ARRAY_ROLES: tuple[str, ...] = ("x", "y", "groups", "x_test", "y_test")


def _load_file(path: Path, options: Mapping[str, Any]) -> Dataset:
    """A ``.npz`` archive, or a directory of ``.npy`` files (memory-mapped, not copied).

    ``options`` may rename the arrays: ``{x: features, y: labels, groups: protein_id}``.
    """
    for key, value in options.items():
        if key not in ARRAY_ROLES:
            raise DataError(
                f"dataset.{key}: not an option of a data file; options name its arrays: "
                f"{', '.join(ARRAY_ROLES)}, got {value!r}"
            )
        if not isinstance(value, str):
            raise DataError(f"dataset.{key} must be the name of an array in the file, got {value!r}")
    names = {role: options.get(role, role) for role in ARRAY_ROLES}
    if path.is_dir():
        arrays, stored = _read_npy_directory(path, names)
    elif path.suffix != ".npz":
        raise DataError(f"dataset: a data file must be a .npz archive or a directory of .npy files, got {str(path)!r}")
    elif not path.is_file():
        raise DataError(f"dataset: data file not found: {str(path)!r}")
    else:
        arrays, stored = _read_npz(path, names)
    # An array the spec names explicitly must be there: a misspelt groups name would otherwise
    # silently drop the groups (and grouped CV would fail later, far from the cause).
    missing = [role for role in ARRAY_ROLES if role not in arrays and (role in ("x", "y") or role in options)]
    if missing:
        raise DataError(_missing_arrays_message(path, names, missing, stored, options))
    dataset = as_class_indices(Dataset.of_arrays(path.stem, arrays))
    check_arrays(dataset, source=str(path))
    if dataset.x.ndim == 2:
        dataset = _with_channel_axis(dataset)
    return dataset


NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"


def _read_npz(path: Path, names: Mapping[str, str]) -> tuple[dict[str, np.ndarray], list[str]]:
    """The arrays found under ``names`` (by role), and the names of every array the file holds."""
    _check_magic(path, ZIP_MAGIC, "a .npz archive (a zip of .npy arrays)")
    try:
        with np.load(path, allow_pickle=False) as stored:
            found = {role: stored[name] for role, name in names.items() if name in stored.files}
            return found, list(stored.files)
    except ValueError as exc:
        raise DataError(f"dataset: cannot read {str(path)!r}: {_array_problem(exc)}") from None
    except (zipfile.BadZipFile, EOFError, OSError, KeyError) as exc:
        raise DataError(
            f"dataset: {str(path)!r} is a damaged or truncated .npz archive: {type(exc).__name__}: {exc}"
        ) from None


def _read_npy_directory(path: Path, names: Mapping[str, str]) -> tuple[dict[str, np.ndarray], list[str]]:
    """The arrays found under ``names`` (by role), and the names of every ``.npy`` file there."""
    arrays = {}
    for role, name in names.items():
        file = path / f"{name}.npy"
        if not file.is_file():
            continue
        _check_magic(file, NPY_MAGIC, "a .npy array")
        try:
            arrays[role] = np.load(file, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:
            raise DataError(f"dataset: cannot read {str(file)!r}: {_array_problem(exc)}") from None
        except (EOFError, OSError) as exc:
            raise DataError(
                f"dataset: {str(file)!r} is a damaged or truncated .npy array: {type(exc).__name__}: {exc}"
            ) from None
    return arrays, sorted(file.stem for file in path.glob("*.npy"))


# Names people commonly give each array, tried (ignoring case) after the role's own name when
# suggesting the renaming a file needs.
USUAL_NAMES: Mapping[str, tuple[str, ...]] = {
    "x": ("features", "inputs", "input", "data", "samples", "x_train"),
    "y": ("labels", "label", "targets", "target", "classes", "y_train"),
    "groups": ("group", "group_id", "group_ids"),
    "x_test": ("features_test", "inputs_test"),
    "y_test": ("labels_test", "targets_test"),
}
UNKNOWN_NAME = "<its name in the file>"


def _missing_arrays_message(
    path: Path, names: Mapping[str, str], missing: list[str], stored: list[str], options: Mapping[str, Any]
) -> str:
    """Which arrays are missing, which the file has, and the spec entry that would name them."""
    absent = " nor ".join(f"{names[role]!r} (for {role})" for role in missing)
    if not stored:
        return f"dataset: {str(path)!r} has no array {absent}; it holds no arrays at all"
    used = {name for role, name in names.items() if role not in missing}
    suggested = {role: name for role, name in options.items() if role not in missing}
    for role in missing:
        suggested[role] = _guess_name(role, [name for name in stored if name not in used])
        used.add(suggested[role])
    unguessed = [role for role in missing if suggested[role] == UNKNOWN_NAME]
    spare = [name for name in stored if name not in used]
    if len(unguessed) == 1 and len(spare) == 1:
        suggested[unguessed[0]] = spare[0]  # the one array left over can only be that one
        spare = []
    # A file that spells x as X likely spells x_test as X_test: named too, or the test split
    # would silently go unused once x and y load.
    for role in ARRAY_ROLES:
        if role not in suggested and names[role] not in stored:
            match = [name for name in spare if name.lower() == role]
            if match:
                suggested[role] = match[0]
    import yaml

    entry = {"path": str(path), **{role: suggested[role] for role in ARRAY_ROLES if role in suggested}}
    spec = yaml.safe_dump(entry, default_flow_style=True, sort_keys=False, width=10**6).strip()
    return (
        f"dataset: {str(path)!r} has no array {absent}; its arrays are {', '.join(stored)}: name the ones "
        f"to use in the spec, e.g. dataset: {spec}"
    )


def _guess_name(role: str, candidates: list[str]) -> str:
    by_lower = {name.lower(): name for name in candidates}
    for usual in (role, *USUAL_NAMES[role]):
        if usual in by_lower:
            return by_lower[usual]
    return UNKNOWN_NAME


def _check_magic(path: Path, magic: bytes, what: str) -> None:
    """Refuse a file that does not even start as ``what`` (numpy would try to unpickle it)."""
    try:
        with path.open("rb") as file:
            start = file.read(len(magic))
    except OSError as exc:
        raise DataError(f"dataset: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    if start != magic:
        raise DataError(f"dataset: {str(path)!r} is not {what}: it starts with {start!r}, not {magic!r}")


def _array_problem(exc: ValueError) -> str:
    if "allow_pickle" in str(exc):
        return "it holds an object array (ragged shapes?); store each array as one rectangular numeric array"
    return str(exc)


def channel_axis_hint(input_shape: tuple[int, ...]) -> str:
    """What to say of samples of ``input_shape`` that a model cannot take, where foldsweep gave
    them their last axis: x of shape (samples, steps) gets a channel axis, as Conv1D takes a signal."""
    if len(input_shape) != 2 or input_shape[-1] != 1:
        return ""
    steps = input_shape[0]
    return (
        f" (x of shape (samples, {steps}) gets a channel axis, as a signal of {steps} steps for Conv1D: a model of "
        f"token ids, an Embedding's, takes it off with keras.layers.Reshape(({steps},)) as its first layer, after "
        f"keras.Input(shape=({steps}, 1)) where it declares its input)"
    )


def _with_channel_axis(dataset: Dataset) -> Dataset:
    test = dataset.x_test[..., None] if dataset.x_test is not None else None
    return replace(dataset, x=dataset.x[..., None], x_test=test)


def check_arrays(dataset: Dataset, *, source: str) -> None:
    """Refuse data that would silently train on garbage: shapes, dtypes, labels, NaN/Inf."""
    pairs = [("x", "y", dataset.x, dataset.y)]
    if (dataset.x_test is None) != (dataset.y_test is None):
        raise DataError(f"dataset: {source} must have both x_test and y_test or neither")
    if dataset.x_test is not None and dataset.y_test is not None:
        pairs.append(("x_test", "y_test", dataset.x_test, dataset.y_test))
    for x_name, y_name, x, y in pairs:
        if x.ndim >= 1 and y.ndim >= 1 and len(x) == len(y) == 0:
            what = (
                "no samples" if x_name == "x" else "no test samples (leave x_test and y_test out when there are none)"
            )
            raise DataError(
                f"dataset: {source} has {what}: arrays {x_name} and {y_name} have length 0, "
                f"shapes {x.shape} and {y.shape}"
            )
        if x.dtype.kind not in "fiu":
            raise DataError(f"dataset: {source} array {x_name} must be numeric, got dtype {x.dtype}")
        if x.ndim < 2:
            raise DataError(f"dataset: {source} array {x_name} must have shape (samples, ...), got {x.shape}")
        _check_label_type(y, y_name, source)
        if len(x) != len(y):
            raise DataError(f"dataset: {source} arrays {x_name} and {y_name} differ in length: {len(x)} vs {len(y)}")
        if y.dtype.kind != "f" and y.ndim == 1 and y.min() < 0:
            raise DataError(
                f"dataset: {source} array {y_name} has negative labels, e.g. {int(y.min())}; "
                f"{_negative_labels_fix(np.unique(y), y_name)}"
            )
        bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1) if x.dtype.kind == "f" else np.zeros(len(x), bool)
        if bad.any():
            raise DataError(
                f"dataset: {source} array {x_name} has {int(bad.sum())} samples with NaN/Inf, "
                f"first at index {int(np.argmax(bad))}"
            )
    if dataset.y.dtype.kind != "f" and dataset.y.ndim == 1:
        _check_labels_start_at_0(dataset, source)
    if dataset.x_test is not None and dataset.x_test.shape[1:] != dataset.x.shape[1:]:
        raise DataError(
            f"dataset: {source} x_test samples have shape {dataset.x_test.shape[1:]}, x has {dataset.x.shape[1:]}"
        )
    if dataset.groups is not None and len(dataset.groups) != len(dataset.y):
        raise DataError(
            f"dataset: {source} arrays groups and y differ in length: {len(dataset.groups)} vs {len(dataset.y)}"
        )


def _check_label_type(y: np.ndarray, name: str, source: str) -> None:
    """Class labels are a 1-D integer array, regression targets floats of any shape that are not
    all whole numbers; the common ways of getting that wrong get a hint."""
    rule = f"dataset: {source} array {name} must be 1-D integer class labels, got dtype {y.dtype} shape {y.shape}"
    if y.dtype.kind == "f" and y.ndim >= 1 and len(y):
        finite = np.isfinite(y.reshape(len(y), -1)).all(axis=1)
        if not finite.all():
            raise DataError(
                f"dataset: {source} array {name} has {int((~finite).sum())} samples with NaN/Inf "
                f"targets, first at index {int(np.argmin(finite))}"
            )
        if (y != np.round(y)).any():
            return  # regression targets
    if y.ndim == 2 and y.shape[1] == 1:
        raise DataError(f"{rule}: one label per sample, flattened: {name}.ravel()")
    if y.ndim == 1 and y.dtype.kind in "US":  # class names stored as text
        raise DataError(f"{rule}: {_number_the_classes(name)}")
    if y.ndim >= 2 and y.dtype.kind in "iu":
        return  # labels per position, checked against the model's output at validate
    if y.ndim == 2:
        raise DataError(
            f"{rule}: one-hot rows (each one 1, 0 elsewhere) load as they are; these are not, so store one class "
            f"number per sample"
        )
    if y.ndim != 1 or y.dtype.kind not in "iuf":
        raise DataError(rule)
    if y.dtype.kind != "f":
        return
    values = np.asarray(y)
    finite = np.isfinite(values)
    if not finite.all():
        raise DataError(f"{rule}, with {int((~finite).sum())} NaN/Inf labels, first at index {int(np.argmin(finite))}")
    fractional = values != np.round(values)
    if fractional.any():
        first = int(np.argmax(fractional))
        raise DataError(
            f"{rule}, with values that are not whole numbers, e.g. {values[first].item()!r} at index {first}: "
            "these look like regression targets, and foldsweep trains classifiers (labels 0..C-1, one per "
            "class); bin them into classes first if that is what you mean"
        )
    raise DataError(
        f"{rule}; its values are whole numbers ({values.min():g} to {values.max():g}): store them as integers, "
        f"{name}.astype(int) in code, np.savez(..., {name}={name}.astype(np.int64)) in the file"
    )


def _negative_labels_fix(classes: np.ndarray, name: str) -> str:
    """How to number labels that go below 0 as classes 0..C-1."""
    if classes.tolist() == [-1, 1]:
        return (
            f"for -1/+1 labels (FordA's, an SVM's) use 0/1: {name} = ({name} > 0).astype(int) "
            f"(np.savez(..., {name}=({name} > 0).astype(np.int64)))"
        )
    return _number_the_classes(name)


def _number_the_classes(name: str) -> str:
    """How to turn any labels (names, numbers not counted from 0) into classes 0..C-1."""
    return (
        f"number the classes 0..C-1: classes = np.unique({name}), then {name} = np.searchsorted(classes, {name}) "
        "(the same classes for y and y_test)"
    )


def _check_labels_start_at_0(dataset: Dataset, source: str) -> None:
    """A model with C outputs predicts classes 0..C-1: labels 1..C, almost always counted from 1,
    would train a C+1st output that no sample ever has."""
    y, y_test = dataset.y, dataset.y_test
    if y.min() >= 1:
        classes = np.unique(y)
        # One class alone is refused before any training with its own message; "start at 0"
        # would misname the problem.
        if len(classes) >= 2:
            hint = (
                "they look counted from 1: shift them, y - 1 (np.savez(..., y=y - 1))"
                if classes[-1] == len(classes)
                else _number_the_classes("y")
            )
            raise DataError(
                f"dataset: {source} array y: labels must start at 0 (a model with C outputs "
                f"predicts classes 0..C-1), got {_label_range(classes)} with no 0; {hint}"
            )
    # A test split may lack class 0 by chance; one whose labels also run past y's is counted from 1.
    if y_test is not None and y_test.min() >= 1 and y_test.max() > y.max():
        hint = (
            "shift them, y_test - 1 (np.savez(..., y_test=y_test - 1))"
            if y_test.max() == y.max() + 1
            else "number them as y's are"
        )
        raise DataError(
            f"dataset: {source} array y_test: labels must start at 0 like y's "
            f"({_label_range(np.unique(y))}), got {_label_range(np.unique(y_test))} with no 0; {hint}"
        )


def _label_range(classes: np.ndarray) -> str:
    if classes[-1] - classes[0] + 1 == len(classes):
        return f"labels {int(classes[0])}..{int(classes[-1])}"
    return "labels " + ", ".join(str(int(label)) for label in classes[:10]) + (", ..." if len(classes) > 10 else "")
