"""``data=synthetic``: a learnable 3D task generated in MedMNIST's layout from a fixed seed, and its file checked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import psutil

from src.config import SPLITS, DataConfig
from src.data.names import replace_fix
from src.data.npz import bad_split, fitted, read_npz, write_npz
from src.errors import UsageError

ARRAYS_CHECKED: set[tuple] = set()  # (path, size, mtime_ns, inode, config) of the synthetic files checked


def check_synthetic(cfg: DataConfig, path: Path) -> bool:
    """Whether the synthetic file for ``cfg`` is at ``path`` (False: to generate), its arrays checked; where it is
    missing, whether the volumes fit in memory; writes nothing."""
    if path.exists():
        check_arrays(cfg, path)
    else:
        check_synthetic_memory(cfg)
    return path.exists()


def check_arrays(cfg: DataConfig, path: Path) -> None:
    """A synthetic file's arrays against ``cfg`` (what :func:`src.data.loaders.load_splits` checks, and the samples its
    name gives), once per version of the file in this process."""
    stat = path.stat()
    key = (path.resolve(), stat.st_size, stat.st_mtime_ns, stat.st_ino, cfg.num_classes, cfg.in_channels, cfg.size)
    if key in ARRAYS_CHECKED:
        return
    for (split, (images, labels)), samples in zip(read_npz(path).items(), cfg.synthetic_samples, strict=True):
        fitted(cfg, path, split, images, labels)
        if len(labels) != samples:
            raise bad_split(path, split, f"{len(labels)} samples, expected {samples} (its name)", replace_fix(path))
    ARRAYS_CHECKED.add(key)


def check_synthetic_memory(cfg: DataConfig) -> None:
    """A :class:`UsageError` where the synthetic volumes ``cfg`` asks for (generated in memory, and trained on from
    there) exceed the memory this machine has free."""
    need, free = sum(cfg.synthetic_samples) * cfg.size**3, psutil.virtual_memory().available
    if need > free:
        raise UsageError(
            f"data.synthetic_samples={list(cfg.synthetic_samples)} at data.size={cfg.size} make {need / 2**30:.1f} GiB "
            f"of volumes, more than the {free / 2**30:.1f} GiB of memory free: lower data.synthetic_samples"
        )


def write_synthetic(cfg: DataConfig, path: Path) -> None:
    """A learnable 3D task in MedMNIST's format: class 0 a ball, class 1 a cube, noisy, random pose.

    Generated from a fixed seed (independent of the training seed), so every run sees the same data.
    """
    rng = np.random.default_rng(12345)
    s = cfg.size
    grid = np.stack(np.meshgrid(*[np.arange(s)] * 3, indexing="ij"), axis=-1).astype(np.float32)
    arrays = {}
    for split, n in zip(SPLITS, cfg.synthetic_samples, strict=True):
        labels = rng.integers(0, cfg.num_classes, size=(n, 1)).astype(np.uint8)
        images = np.empty((n, s, s, s), np.uint8)
        for i, label in enumerate(labels[:, 0]):
            centre = rng.uniform(0.35 * s, 0.65 * s, size=3)
            radius = rng.uniform(0.15 * s, 0.25 * s)
            offset = grid - centre
            dist = np.sqrt((offset**2).sum(-1)) if label == 0 else np.abs(offset).max(-1) / (1 + 0.2 * (label - 1))
            shape = (dist <= radius).astype(np.float32)
            images[i] = np.clip(200 * shape + rng.normal(30, 25, size=(s, s, s)), 0, 255).astype(np.uint8)
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = images, labels
    write_npz(path, arrays, compressed=True)
