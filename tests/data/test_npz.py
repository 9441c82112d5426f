"""The `.npz` layout every kind of file shares (:mod:`src.data.npz`): arrays of another format, a corrupt, damaged or
empty file, each refused in one line with the fix for its kind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from src.config import DataConfig
from src.data.files import npz_path
from src.data.loaders import load_splits
from src.data.synthetic import ARRAYS_CHECKED
from tests.data.helpers import REGENERATE, refusal, synthetic


def rewritten(cfg: DataConfig, **arrays: np.ndarray) -> Path:
    """``cfg``'s synthetic file, generated, with ``arrays`` put in its place."""
    load_splits(cfg)
    path = npz_path(cfg)
    with np.load(path) as npz:
        kept = dict(npz)
    np.savez(path, **{**kept, **arrays})
    return path


NAN_IMAGES = np.full((8, 28, 28, 28), np.nan, np.float32)
BAD_ARRAYS = {
    "nan images": (
        {"train_images": NAN_IMAGES},
        "train split: images of dtype float32, expected uint8 (MedMNIST's format)",
    ),
    "labels too large": (
        {"train_labels": np.arange(8).reshape(8, 1) % 3},
        "train split: labels in [0, 2], expected [0, 2) for data.num_classes=2",
    ),
    "negative label": (
        {"val_labels": np.array([0, -1, 1, 0])},
        "val split: labels in [-1, 1], expected [0, 2) for data.num_classes=2",
    ),
    "float labels": ({"test_labels": np.zeros((4, 1))}, "test split: labels of dtype float64, expected integers"),
    "fewer labels": (
        {"test_labels": np.zeros((3, 1), np.uint8)},
        "test split: 4 images but labels of shape (3, 1), expected one label per image",
    ),
    "two labels an image": (
        {"train_labels": np.zeros((8, 2), np.uint8)},
        "train split: 8 images but labels of shape (8, 2), expected one label per image",
    ),
    "empty split": (
        {"val_images": np.zeros((0, 28, 28, 28), np.uint8), "val_labels": np.zeros((0, 1), np.uint8)},
        "val split: no samples, expected at least one",
    ),
}


@pytest.mark.parametrize("arrays, what", BAD_ARRAYS.values(), ids=BAD_ARRAYS)
def test_bad_arrays_are_refused_on_load_with_the_fix(tmp_path, arrays, what):
    cfg = synthetic(tmp_path)
    path = rewritten(cfg, **arrays)
    assert refusal(load_splits, cfg) == f"{path}, {what}: {REGENERATE}"
    path.unlink()  # the fix: regenerated, it loads
    assert len(load_splits(cfg)["val"][1]) == 4


def test_corrupt_synthetic_file_is_told_to_delete_it(tmp_path):
    cfg = synthetic(tmp_path)
    npz_path(cfg).write_bytes(b"not a zip")
    message = refusal(load_splits, cfg)
    assert message.startswith(f"{npz_path(cfg)} is not a MedMNIST .npz (") and message.endswith(f"): {REGENERATE}")


def flipped_stream(path: Path) -> None:
    """64 bytes of the file's first compressed member overwritten: its zip headers stay, its deflate stream breaks."""
    data = bytearray(path.read_bytes())
    data[100:164] = b"\xff" * 64
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [flipped_stream, lambda path: path.write_bytes(b"")], ids=["stream", "empty"])
def test_a_damaged_or_empty_file_is_told_to_delete_it(tmp_path, damage):
    """A broken deflate stream raised zlib.error, an empty file EOFError: tracebacks."""
    cfg = synthetic(tmp_path)
    load_splits(cfg)
    damage(npz_path(cfg))
    ARRAYS_CHECKED.clear()  # what this process checked of the file before it changed in the same second
    message = refusal(load_splits, cfg)
    assert message.startswith(f"{npz_path(cfg)} is not a MedMNIST .npz (") and message.endswith(f"): {REGENERATE}")
