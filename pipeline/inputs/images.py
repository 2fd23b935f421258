"""Image folders: a folder with a subfolder of image files per class, the layout Keras'
``image_dataset_from_directory`` reads (``dataset: {images: DIR}``), decoded once into arrays.

The classes are the subfolders' names in sorted order (Keras' order), labelled 0..C-1; a folder
holding ``train/`` and ``test/``, each in that layout, gives the held-out test split too. Images
are decoded to float32 values 0-255 in ``color_mode`` as Keras gives them (by Pillow; in grayscale by
TensorFlow's decoder, as Keras, whose conversion to grey Pillow's does not round alike) and never
resized: every image must have the folder's size (``image_size``, else the first image's), and
one that does not is refused by name, as is one that cannot be decoded. The decoded arrays are
cached in a folder of ``.npy`` files named by a fingerprint of the files (their paths, sizes and
modification times) and of the options, and read memory-mapped by every later command.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.base.errors import DataError
from pipeline.inputs.spec import DEFAULT_COLOR_MODE

# The files image_dataset_from_directory reads, by suffix (any case).
IMAGE_SUFFIXES = (".bmp", ".gif", ".jpeg", ".jpg", ".png")
PILLOW_MODES = {"rgb": "RGB", "grayscale": "L", "rgba": "RGBA"}  # spec.COLOR_MODES as Pillow names them
CHANNELS = {"rgb": 3, "grayscale": 1, "rgba": 4}
SPLIT_FOLDERS = ("train", "test")


def read_image_folder(folder: Path, options: Mapping[str, Any], *, cache_root: Path) -> dict[str, Any]:
    """``{x, y, x_test?, y_test?}`` arrays and ``class_names`` of an image folder (module docstring),
    from the cache when the files are unchanged.

    Raises:
        DataError: no such folder, no class subfolders, an empty class, an image that cannot be
            decoded or whose size is not the folder's.
    """
    color_mode = options.get("color_mode", DEFAULT_COLOR_MODE)
    size = options.get("image_size")
    splits = _splits(folder)
    class_names = _class_names(folder, splits)
    files = {split: _files(directory, class_names, test=split == "test") for split, directory in splits.items()}
    key = _fingerprint(folder, files, color_mode, size)
    cache = cache_root / f"images-{key}"
    arrays = _read_cached(cache)
    if arrays is None:
        shape = tuple(size) if size is not None else _first_size(files["train"][0][0])
        arrays = {}
        for split, listed in files.items():
            x, y = _decoded(listed, color_mode=color_mode, size=shape, explicit=size is not None)
            arrays["x" if split == "train" else "x_test"], arrays["y" if split == "train" else "y_test"] = x, y
        _write_cached(cache, arrays)
        arrays = _read_cached(cache) or arrays
    return {**arrays, "class_names": tuple(class_names)}


def _splits(folder: Path) -> dict[str, Path]:
    if not folder.is_dir():
        raise DataError(f"dataset.images: folder not found: {str(folder)!r}")
    subfolders = {path.name for path in folder.iterdir() if path.is_dir()}
    if subfolders == set(SPLIT_FOLDERS):
        return {split: folder / split for split in SPLIT_FOLDERS}
    return {"train": folder}


def _class_names(folder: Path, splits: Mapping[str, Path]) -> list[str]:
    names = sorted(path.name for path in splits["train"].iterdir() if path.is_dir())
    if not names:
        raise DataError(
            f"dataset.images: {str(splits['train'])!r} has no class subfolders; an image folder holds one "
            f"subfolder of image files per class ({str(folder)}/<class>/<image>.png), as Keras' "
            "image_dataset_from_directory reads it"
        )
    if "test" in splits:
        extra = sorted(path.name for path in splits["test"].iterdir() if path.is_dir() and path.name not in names)
        if extra:
            raise DataError(
                f"dataset.images: {str(splits['test'])!r} has classes the training images lack: {', '.join(extra)}"
            )
    return names


def _files(directory: Path, class_names: Sequence[str], *, test: bool) -> list[tuple[Path, int]]:
    """(image file, label) for every image under the class subfolders, walked as Keras walks them."""
    files = []
    for label, name in enumerate(class_names):
        class_folder = directory / name
        found = sorted(
            Path(root) / file
            for root, _, names in os.walk(class_folder)
            for file in names
            if Path(file).suffix.lower() in IMAGE_SUFFIXES
        )
        if not found and not test:
            raise DataError(
                f"dataset.images: class folder {str(class_folder)!r} has no image files "
                f"({', '.join(IMAGE_SUFFIXES)}); a class must have samples to be learnt"
            )
        files += [(path, label) for path in found]
    return files


def _fingerprint(folder: Path, files: Mapping[str, list[tuple[Path, int]]], color_mode: str, size: Any) -> str:
    options: dict[str, Any] = {"color_mode": color_mode, "image_size": size}
    if color_mode == "grayscale":  # the decoder makes the grey levels (``_grayscale_as_keras_decodes``)
        options["decoder"] = "tensorflow"
    digest = hashlib.sha256(json.dumps(options).encode())
    for split, listed in files.items():
        for path, label in listed:
            stat = path.stat()
            digest.update(
                f"{split}\0{path.relative_to(folder)}\0{label}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode()
            )
    return digest.hexdigest()[:16]


def _open(path: Path) -> Any:
    from PIL import Image

    try:
        image = Image.open(path)
        image.load()
    except Exception as exc:
        raise DataError(
            f"dataset.images: cannot decode image {str(path)!r}: {type(exc).__name__}: {exc}; remove or replace the file"
        ) from None
    return image


def _first_size(path: Path) -> tuple[int, int]:
    width, height = _open(path).size
    return height, width


def _decoded(
    files: list[tuple[Path, int]], *, color_mode: str, size: tuple[int, ...], explicit: bool
) -> tuple[np.ndarray, np.ndarray]:
    channels = CHANNELS[color_mode]
    x = np.empty((len(files), size[0], size[1], channels), np.float32)
    y = np.empty(len(files), np.int64)
    for i, (path, label) in enumerate(files):
        image = _open(path)
        height, width = image.size[1], image.size[0]
        if (height, width) != tuple(size):
            where = "dataset.image_size" if explicit else f"the first image's, {str(files[0][0])!r}"
            raise DataError(
                f"dataset.images: image {str(path)!r} is {height}x{width} (height x width), not {size[0]}x{size[1]} "
                f"({where}); foldsweep does not resize images: make them one size first"
            )
        if color_mode == "grayscale":
            pixels = _grayscale_as_keras_decodes(path)
        else:
            pixels = np.asarray(image.convert(PILLOW_MODES[color_mode]), np.float32)
        x[i] = pixels.reshape(size[0], size[1], channels)
        y[i] = label
    return x, y


def _grayscale_as_keras_decodes(path: Path) -> np.ndarray:
    """An image's pixels in one channel as image_dataset_from_directory decodes them: TensorFlow's
    decoder, asked for one channel. Pillow's conversion of colour to grey rounds otherwise (one
    level apart on about half the pixels of an RGB PNG)."""
    from pipeline.base.quiet import import_tensorflow_and_keras

    import_tensorflow_and_keras()
    import tensorflow as tf

    decoded = tf.io.decode_image(tf.io.read_file(str(path)), channels=1, expand_animations=False)
    return np.asarray(decoded, np.float32)


def _read_cached(cache: Path) -> dict[str, np.ndarray] | None:
    if not (cache / "x.npy").is_file():
        return None
    try:
        return {file.stem: np.load(file, mmap_mode="r", allow_pickle=False) for file in sorted(cache.glob("*.npy"))}
    except (OSError, ValueError):
        return None  # a damaged cache is decoded again, not trusted


def _write_cached(cache: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Written into a temporary folder and renamed, so that concurrent commands never read half of it."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        temporary = Path(tempfile.mkdtemp(dir=cache.parent, prefix=f".{cache.name}-"))
    except OSError as exc:
        raise DataError(
            f"dataset.images: decoded images are cached in {str(cache.parent)!r}, but nothing can be written there "
            f"({exc.strerror or exc})"
        ) from None
    try:
        for name, array in arrays.items():
            np.save(temporary / f"{name}.npy", array, allow_pickle=False)
        os.replace(temporary, cache)
    except OSError:
        if not (cache / "x.npy").is_file():  # another command's copy is as good as this one
            raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
