"""Volumes to uint8 cubes: headers read first (nibabel) to refuse a bad file before any work, then MONAI's
transforms: RAS orientation, resampling to one spacing (trilinear), intensity to [0, 1], a centred crop or zero pad
to ``data.size`` on each side, and [0, 1] to 0..255."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from src.config import DataConfig, Intensity
from src.errors import UsageError
from src.volumes.table import Row, Table

ZSCORE_CLIP = 3.0  # intensity=zscore: the standard deviations kept either side of the mean


@dataclass(frozen=True)
class Header:
    shape: tuple[int, ...]
    spacing: tuple[float, ...]  # voxel size in mm along R, A, S


def unreadable(table: Table, row: Row, err: Exception) -> UsageError:
    detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return UsageError(
        f"{table.at(row)}: {row.path} is not a volume nibabel reads ({detail}): replace it, or drop the row"
    )


def read_header(table: Table, row: Row) -> Header:
    """The volume's shape and its voxel size along R, A, S (its axes in RAS order), from the header alone."""
    import nibabel as nib  # here: every command imports src.data, few build a cache

    try:
        image = nib.load(row.path)
        affine, shape = image.affine, image.shape
    except Exception as err:  # nibabel and gzip raise assorted errors on a bad file
        raise unreadable(table, row, err) from None
    spacing = np.empty(3)
    spacing[nib.orientations.io_orientation(affine)[:, 0].astype(int)] = nib.affines.voxel_sizes(affine)
    return Header(tuple(shape), tuple(spacing.round(4).tolist()))


def check_layout(cfg: DataConfig, table: Table, headers: list[Header]) -> None:
    """One dimensionality for every volume: 3-D, or 4-D with the channels last; ``data.in_channels`` channels."""
    first, shape = table.rows[0], headers[0].shape
    for row, header in zip(table.rows, headers, strict=True):
        if len(header.shape) != len(shape):
            raise UsageError(
                f"{table.csv}: volumes of mixed dimensionality: {first.image} (line {first.line}) is "
                f"{len(shape)}-D {shape}, "
                f"{row.image} (line {row.line}) is {len(header.shape)}-D {header.shape}: give every volume one "
                f"layout (3-D, or 4-D with the channels last)"
            )
        if len(header.shape) not in (3, 4):
            raise UsageError(
                f"{table.at(row)}: {row.image} is {len(header.shape)}-D {header.shape}: give 3-D volumes, "
                f"or 4-D with the channels last"
            )
        channels = header.shape[3] if len(header.shape) == 4 else 1
        if channels != cfg.in_channels:
            raise UsageError(
                f"{table.at(row)}: {row.image} {header.shape} has {channels} channel{'s' if channels > 1 else ''}, "
                f"expected data.in_channels={cfg.in_channels}: set data.in_channels={channels}"
            )


def monai_transforms() -> ModuleType:
    """``monai.transforms``, imported with torchvision kept out: importing MONAI tries it for optional networks, and a
    torchvision built for another torch fails half-way through its import; none of these transforms use it."""
    kept_out = "torchvision" not in sys.modules
    if kept_out:
        sys.modules["torchvision"] = None  # its import raises ImportError, which MONAI's optional_import expects
    try:
        import monai.transforms
    finally:
        if kept_out:
            del sys.modules["torchvision"]
    return monai.transforms


def pipeline(cfg: DataConfig, spacing: list[float]) -> Callable[[Any], torch.Tensor]:
    """MONAI's transforms from a file to a float ``(C, S, S, S)`` cube in [0, 1] (zero outside the volume)."""
    t = monai_transforms()
    if cfg.intensity is Intensity.window:
        low = cfg.window_level - cfg.window_width / 2
        to_unit = [t.ScaleIntensityRange(low, low + cfg.window_width, 0.0, 1.0, clip=True)]
    elif cfg.intensity is Intensity.zscore:
        clipped = t.ScaleIntensityRange(-ZSCORE_CLIP, ZSCORE_CLIP, 0.0, 1.0, clip=True)
        to_unit = [t.NormalizeIntensity(channel_wise=True), clipped]
    else:
        to_unit = [t.ScaleIntensity(0.0, 1.0, channel_wise=True)]
    return t.Compose(
        [
            t.LoadImage(reader="NibabelReader", image_only=True),
            t.EnsureChannelFirst(),
            t.Orientation("RAS", labels=None),
            t.Spacing(spacing, mode="bilinear"),
            *to_unit,
            t.ResizeWithPadOrCrop([cfg.size] * 3),
        ]
    )


def cube(transform: Callable[[Any], torch.Tensor], table: Table, row: Row) -> tuple[np.ndarray, str]:
    """One volume as a uint8 ``(C, S, S, S)`` cube, and its file's MD5."""
    try:
        unit = transform(row.path)
    except Exception as err:  # a file whose header read but whose voxels do not (truncated, corrupt)
        raise unreadable(table, row, err) from None
    return unit.as_tensor().mul(255).round().to(torch.uint8).numpy(), hashlib.md5(row.path.read_bytes()).hexdigest()


def cubes(cfg: DataConfig, spacing: list[float], table: Table) -> list[tuple[np.ndarray, str]]:
    """:func:`cube` for every row, in the table's order: one volume per core on threads sharing the transforms, as
    MONAI's ThreadDataLoader does (nibabel's gzip and torch's kernels release the GIL), each torch op on one thread;
    a progress bar on a terminal; the first failure cancels the volumes not started."""
    transform = pipeline(cfg, spacing)
    threads, pool = torch.get_num_threads(), ThreadPoolExecutor(min(len(os.sched_getaffinity(0)), len(table.rows)))
    torch.set_num_threads(1)
    try:
        futures = [pool.submit(cube, transform, table, row) for row in table.rows]
        for done in tqdm(as_completed(futures), total=len(futures), desc="preprocessing", unit="volume", disable=None):
            done.result()
    finally:
        pool.shutdown(cancel_futures=True)
        torch.set_num_threads(threads)
    return [future.result() for future in futures]
