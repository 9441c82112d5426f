"""The `.npz` layout every kind of data file shares, MedMNIST's (``train_images`` uint8 ``(N, D, H, W)`` or
``(N, C, D, H, W)``, ``train_labels`` ``(N, 1)``, then ``val_*`` and ``test_*``): written, read and checked, and one
split as tensors checked against the config; every refusal one line with the fix for the file's kind."""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch

from src.atomic import atomic_path, uninterrupted
from src.config import SPLITS, DataConfig
from src.data.names import replace_fix
from src.errors import UsageError


def write_npz(path: Path, arrays: dict[str, np.ndarray], compressed: bool) -> None:
    """``arrays`` as the `.npz` ``path``, whole or absent; a stop signal during the write acts as it ends (cut, the
    zip writer's cleanup fails over the signal's exception and leaves a traceback)."""
    with uninterrupted(f"writing {path.name}"), atomic_path(path) as partial, partial.open("wb") as out:
        (np.savez_compressed if compressed else np.savez)(out, **arrays)


def read_npz(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{split: (images uint8 (N, D, H, W) or (N, C, D, H, W), labels int64 (N,))}``, N >= 1; a file in another
    format is refused with the fix for its kind (:func:`replace_fix`)."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {s: (npz[f"{s}_images"], npz[f"{s}_labels"]) for s in SPLITS}
    except (KeyError, ValueError, OSError, EOFError, zlib.error, zipfile.BadZipFile) as err:  # EOFError: empty
        raise UsageError(f"{path} is not a MedMNIST .npz ({err}): {replace_fix(path)}") from None
    for split, (images, labels) in arrays.items():
        problem = format_problem(images, labels)
        if problem:
            raise bad_split(path, split, problem, replace_fix(path))
    return {s: (images, labels.reshape(-1).astype(np.int64)) for s, (images, labels) in arrays.items()}


def format_problem(images: np.ndarray, labels: np.ndarray) -> str | None:
    """What keeps a split from MedMNIST's format (uint8 volumes, one integer label each, a sample at least), or None;
    no pass over the voxels."""
    if images.dtype != np.uint8:
        return f"images of dtype {images.dtype}, expected uint8 (MedMNIST's format)"
    if images.ndim not in (4, 5):
        return f"images of shape {images.shape}, expected (N, D, H, W) or (N, C, D, H, W)"
    if not np.issubdtype(labels.dtype, np.integer):
        return f"labels of dtype {labels.dtype}, expected integers"
    if labels.shape not in ((len(images),), (len(images), 1)):
        return f"{len(images)} images but labels of shape {labels.shape}, expected one label per image"
    if not len(images):
        return "no samples, expected at least one"
    return None


def bad_split(path: Path, split: str, problem: str, fix: str) -> UsageError:
    """The one-line refusal of a split: the file, the split, what is wrong, the fix."""
    return UsageError(f"{path}, {split} split: {problem}: {fix}")


def fitted(
    cfg: DataConfig, path: Path, split: str, images: np.ndarray, labels: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """One split of :func:`read_npz` as tensors, its sample shape and label range checked against ``cfg``."""
    x = torch.from_numpy(images)
    x = x.unsqueeze(1) if x.ndim == 4 else x
    shape = (cfg.in_channels, cfg.size, cfg.size, cfg.size)
    if tuple(x.shape[1:]) != shape:
        problem = f"sample shape {tuple(x.shape[1:])}, expected {shape}"
        raise bad_split(path, split, problem, "check data.size and data.in_channels")
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= cfg.num_classes:
        problem = f"labels in [{low}, {high}], expected [0, {cfg.num_classes}) for data.num_classes={cfg.num_classes}"
        raise bad_split(path, split, problem, replace_fix(path))  # a MedMNIST file's classes: check_official
    return x, torch.from_numpy(labels)
