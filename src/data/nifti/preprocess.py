"""Volumes to uint8 cubes: headers read first (nibabel) to refuse a bad file before any work, then each volume read
once, whole and checked (:mod:`src.data.nifti.snapshot`: a compressed stream to its end, the bytes its header implies,
the file unchanged since the cache's key was taken), and MONAI's transforms on those bytes: RAS orientation,
resampling to one spacing (trilinear), intensity to [0, 1], a centred crop or zero pad to ``data.size`` on each side,
and [0, 1] to 0..255."""

from __future__ import annotations

import math
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
from src.data.nifti import snapshot
from src.data.nifti.snapshot import Stamp
from src.data.nifti.table import Row, Table
from src.errors import UsageError

ZSCORE_CLIP = 3.0  # intensity=zscore: the standard deviations kept either side of the mean
RESAMPLED_MAX = 2**30  # voxels per channel of one resampled volume (4 GiB as float32): a voxel size 1000x off refused
ONE_FILE = ("Nifti1Image", "Nifti2Image", "MGHImage")  # nibabel's volumes in one file (read whole, from bytes)


@dataclass(frozen=True)
class Header:
    shape: tuple[int, ...]
    spacing: tuple[float, ...]  # voxel size in mm along R, A, S
    extent: tuple[float, ...]  # the volume's size in mm along R, A, S
    kind: type  # nibabel's image class, which reads the volume from its bytes
    end: int  # the bytes the header implies: its data's offset and the voxels' (decompressed, where compressed)


@dataclass(frozen=True)
class Pipeline:
    """:func:`pipeline`'s transforms in two, the voxels checked between them."""

    load: Callable[[str, Any], torch.Tensor]  # a file's name and its nibabel image to its float (C, ...) voxels
    to_cube: Callable[[torch.Tensor], torch.Tensor]  # those to a (C, S, S, S) cube in [0, 1]


def unreadable(table: Table, row: Row, err: BaseException) -> UsageError:
    """Named by the first error in the chain: MONAI wraps nibabel's in "applying transform <LoadImage ...>"."""
    while err.__cause__ is not None:
        err = err.__cause__
    detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return UsageError(
        f"{table.at(row)}: {row.path} is not a volume nibabel reads ({detail}): replace it, or drop the row"
    )


def read_header(table: Table, row: Row, stamp: Stamp) -> Header:
    """The volume's shape, its voxel size and extent along R, A, S (its axes in RAS order), from the header alone; a
    format of two files, an uncompressed file shorter than its header implies (``stamp``: its size), an empty volume,
    voxels that are not real numbers (complex, RGB) and an affine without a positive voxel size (to 0.0001 mm) and a
    direction of its own along each axis refused."""
    import nibabel as nib  # here: every command imports this module (through src.data.files), few build a cache

    monai_transforms()  # MONAI imported with torchvision kept out, before its data utilities
    from monai.data.utils import correct_nifti_header_if_necessary

    try:  # the affine MONAI's NibabelReader resamples with: an sform that disagrees with pixdim gives way to the qform
        loaded = nib.load(row.path)
        image = correct_nifti_header_if_necessary(loaded)
        affine, shape, dtype = image.affine, image.shape, image.get_data_dtype()
    except Exception as err:  # nibabel and gzip raise assorted errors on a bad file
        raise unreadable(table, row, err) from None
    kind = type(loaded)
    if kind.__name__ not in ONE_FILE:  # a .hdr/.img pair: two files cannot be read once, whole, and checked unchanged
        raise UsageError(
            f"{table.at(row)}: {row.path} is a {kind.__name__}, not a volume in one file (NIfTI .nii or .nii.gz, MGH "
            f".mgz): save it as .nii.gz, or drop the row"
        )
    suffix = row.path.suffix.lower()
    if suffix in nib.openers.Opener.compress_ext_map and snapshot.compression(row.path) is None:  # .zst, with pyzstd
        raise UsageError(
            f"{table.at(row)}: {row.path} is compressed as {suffix}, a stream data=nifti does not check whole: "
            f"save it as .nii.gz, or drop the row"
        )
    end = int(loaded.dataobj.offset) + math.prod(shape) * dtype.itemsize  # the header of an image read says 0
    if snapshot.compression(row.path) is None:
        check_size(table, row, end, stamp.size)
    if 0 in shape:
        raise UsageError(f"{table.at(row)}: {row.image} holds no voxels (shape {shape}): replace it, or drop the row")
    if dtype.kind not in "biuf":  # MONAI would keep a complex volume's real part, silently
        raise UsageError(
            f"{table.at(row)}: {row.image} holds {dtype} voxels, not real numbers: save it as real values (the "
            f"magnitude of complex data; colour as 4-D channels), or drop the row"
        )
    if not np.isfinite(affine).all():  # a NaN origin passes the voxel sizes, and resampling makes the cube blank
        raise UsageError(
            f"{table.at(row)}: {row.path} has NaN or infinite numbers in its affine ({affine[:3].tolist()}): give its "
            f"header an sform or qform of finite numbers, or drop the row"
        )
    sizes = nib.affines.voxel_sizes(affine).round(4)
    positive = np.isfinite(sizes).all() and sizes.min() > 0
    axes = nib.orientations.io_orientation(affine)[:, 0] if positive else None  # NaN where axes share a direction
    if axes is None or not np.isfinite(axes).all():
        raise UsageError(
            f"{table.at(row)}: {row.path} has a degenerate affine (voxel sizes {sizes.tolist()} mm): give its header "
            f"an sform or qform with a positive voxel size and its own direction along each axis, or drop the row"
        )
    spacing, extent = np.empty(3), np.empty(3)
    spacing[axes.astype(int)] = sizes
    extent[axes.astype(int)] = sizes * (*shape, 1, 1)[:3]  # a 2-D image one voxel thick (refused by check_layout)
    return Header(tuple(shape), tuple(spacing.tolist()), tuple(extent.tolist()), kind, end)


def check_size(table: Table, row: Row, end: int, size: int, compressed: bool = False) -> None:
    """The volume's bytes (``size``) hold what its header implies (``end``), and less than as many again: a header
    whose dimensions outgrow its file (its voxels would be allocated first), a file cut short, or far longer."""
    once = " once decompressed" if compressed else ""
    if size < end:
        raise UsageError(
            f"{table.at(row)}: {row.path} is cut short: its header implies {end} bytes, the file holds {size}{once}: "
            f"replace it, or drop the row"
        )
    if size > 2 * end:
        raise UsageError(
            f"{table.at(row)}: {row.path} holds more than twice the {end} bytes its header implies{once}: replace "
            f"it, or drop the row"
        )


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


def check_resampled(table: Table, headers: list[Header], spacing: list[float]) -> None:
    """Every volume resampled to ``spacing`` within :data:`RESAMPLED_MAX` voxels (a voxel size 1000x too small in a
    header, or a median of such, would fill the memory)."""
    for row, header in zip(table.rows, headers, strict=True):
        voxels = [max(1, round(mm / size)) for mm, size in zip(header.extent, spacing, strict=True)]
        if np.prod(voxels, dtype=float) > RESAMPLED_MAX:
            raise UsageError(
                f"{table.at(row)}: {row.image} ({' x '.join(f'{s:g}' for s in header.spacing)} mm voxels) resampled "
                f"to {spacing} mm would be {' x '.join(map(str, voxels))} voxels, more than {RESAMPLED_MAX}: set "
                f"data.spacing to larger voxels, or fix the voxel sizes in the headers"
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


def pipeline(cfg: DataConfig, spacing: list[float]) -> Pipeline:
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
    from monai.data import NibabelReader
    from monai.data.utils import correct_nifti_header_if_necessary

    class Verified(NibabelReader):
        """MONAI's reader of an image read and checked already (:func:`cube`), its header corrected as its own
        ``read`` would: MONAI reads no file."""

        def __init__(self, image: Any) -> None:
            super().__init__()
            self.image = image

        def read(self, data: Any, **kwargs: Any) -> Any:
            self.filenames = (data,) if isinstance(data, str) else tuple(data)
            return correct_nifti_header_if_necessary(self.image)

    loader = t.LoadImage(reader="NibabelReader", image_only=True, ensure_channel_first=True)
    resample = [t.Orientation("RAS", labels=None), t.Spacing(spacing, mode="bilinear")]
    return Pipeline(
        lambda name, image: loader(name, reader=Verified(image)),
        t.Compose([*resample, *to_unit, t.ResizeWithPadOrCrop([cfg.size] * 3)]),
    )


def cube(transforms: Pipeline, table: Table, row: Row, header: Header, stamp: Stamp) -> tuple[np.ndarray, str]:
    """One volume as a uint8 ``(C, S, S, S)`` cube, and its file's MD5: its bytes read once, whole (a compressed
    stream to its end: CRC and length), as many as its header implies, the file unchanged since ``stamp`` (the
    cache's key) to its last byte; a NaN or infinite voxel refused (resampling and scaling would spread it, or make
    the cube zero)."""
    try:
        read = snapshot.read(row.path, 2 * header.end, before=stamp, decompress=True)
    except snapshot.Changed as err:
        raise UsageError(
            f"{table.at(row)}: {row.path} changed while the cache was built ({err}): run again once nothing writes "
            f"to data.root={table.root}"
        ) from None
    except snapshot.Damaged as err:
        raise UsageError(
            f"{table.at(row)}: {row.path} is damaged ({err}): replace it with an intact copy, or drop the row"
        ) from None
    except OSError as err:
        raise UsageError(f"{table.at(row)}: cannot read {row.path} ({err.strerror}): fix it, or drop the row") from None
    check_size(table, row, header.end, read.size, compressed=snapshot.compression(row.path) is not None)
    try:
        voxels = transforms.load(str(row.path), header.kind.from_stream(read.data))
    except Exception as err:  # bytes whose header read but whose voxels do not
        raise unreadable(table, row, err) from None
    bad = voxels.numel() - int(torch.isfinite(voxels).sum())
    if bad:
        raise UsageError(
            f"{table.at(row)}: {row.path} has {bad} NaN or infinite voxel{'s' if bad > 1 else ''}: make each a "
            f"number (e.g. the background value), or drop the row"
        )
    unit = transforms.to_cube(voxels)
    return unit.as_tensor().mul(255).round().to(torch.uint8).numpy(), read.md5


def cubes(
    cfg: DataConfig, spacing: list[float], table: Table, headers: list[Header], stamps: list[Stamp]
) -> list[tuple[np.ndarray, str]]:
    """:func:`cube` for every row, in the table's order: one volume per core on threads sharing the transforms, as
    MONAI's ThreadDataLoader does (nibabel's gzip and torch's kernels release the GIL), each torch op on one thread;
    a progress bar on a terminal; the first failure cancels the volumes not started."""
    transforms = pipeline(cfg, spacing)
    threads, pool = torch.get_num_threads(), ThreadPoolExecutor(min(len(os.sched_getaffinity(0)), len(table.rows)))
    torch.set_num_threads(1)
    try:
        futures = [
            pool.submit(cube, transforms, table, row, header, stamp)
            for row, header, stamp in zip(table.rows, headers, stamps, strict=True)
        ]
        for done in tqdm(as_completed(futures), total=len(futures), desc="preprocessing", unit="volume", disable=None):
            done.result()
    finally:
        pool.shutdown(cancel_futures=True)
        torch.set_num_threads(threads)
    return [future.result() for future in futures]
