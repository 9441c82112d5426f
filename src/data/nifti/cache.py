"""The cache of ``data=nifti``: the preprocessed volumes as one uncompressed `.npz` in MedMNIST's layout
(``train_images`` uint8 ``(N, S, S, S)``, or ``(N, C, S, S, S)`` with channels, ``train_labels`` ``(N, 1)``, then
``val_*`` and ``test_*``), read by training as it reads a MedMNIST file.

It lives in ``$MEDSWEEP_CACHE_DIR/volumes`` when that is set, else in ``<data.root>/.medsweep``. Its name carries a key
of what it holds: each row (image, class, split) with its file's size and mtime, the classes, the preprocessing keys
and :data:`FORMAT`; a changed file, row or key names another file, built on first use. It is built from what the key
names (:mod:`src.data.nifti.snapshot`): the CSV's rows as read once, each volume's bytes read whole and checked
unchanged since its stamp was taken for the key; a file changed meanwhile refuses the build. Its ``meta`` entry is a
JSON record: the MD5 of the CSV and the files (the MLflow dataset digest), the spacing used and the spacings seen, and
each split's images in order (the ``index`` of ``eval/test_predictions.csv``).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from src.config import NIFTI, SPLITS, DataConfig, Intensity
from src.data.nifti.preprocess import Header, check_layout, check_resampled, cubes, read_header
from src.data.nifti.snapshot import Stamp, stamp
from src.data.nifti.table import Row, Table, read_table
from src.data.npz import write_npz
from src.errors import UsageError
from src.folders import CACHE_ENV

log = logging.getLogger(__name__)

FORMAT = 3  # how a cache is made: bump it when the preprocessing changes (2: headers read as MONAI reads them; 3:
# volumes read whole and checked: one built from a damaged stream is not used)
FOLDER_BYTES = 100  # the folder's name in the cache's, cut to this many bytes of UTF-8 (a file name: 255 bytes at most)


def preprocessing(cfg: DataConfig) -> dict[str, Any]:
    """The keys that decide the cubes (``spacing`` as given: its default, the median, follows from the files)."""
    keys = {"size": cfg.size, "in_channels": cfg.in_channels, "spacing": cfg.spacing, "intensity": cfg.intensity.value}
    if cfg.intensity is Intensity.window:
        keys |= {"window_level": cfg.window_level, "window_width": cfg.window_width}
    return keys


def stamps(cfg: DataConfig, table: Table) -> list[Stamp]:
    """Each row's file's stamp (its size and time name the cache; the build checks each file still has it); refuses a
    row whose file cannot be found, is no file, or is another row's under another name (a hard link: the CSV's check
    of paths sees links that resolve to one path)."""
    found: list[Stamp] = []
    rows: dict[tuple[int, int], Row] = {}
    for row in table.rows:
        try:
            found.append(stamp(row.path))
        except OSError as err:
            raise UsageError(
                f"{table.at(row)}: cannot read {row.path} ({err.strerror}): fix the image path (relative to "
                f"data.root={cfg.root}), or remove the row"
            ) from None
        if not found[-1].regular:  # a FIFO would block the read for ever
            raise UsageError(f"{table.at(row)}: {row.path} is not a file: put the volume there, or remove the row")
        first = rows.setdefault(found[-1].inode, row)
        if first is not row:
            raise UsageError(
                f"{table.at(row)}: {row.image} is line {first.line}'s file ({first.image}, a hard link to it) too: "
                f"one row per volume"
            )
    return found


def cache_path(cfg: DataConfig, table: Table, stamped: list[Stamp] | None = None) -> Path:
    """The cache file for ``cfg`` (whether built or not), named by the files' stamps (``stamped``, else taken now)."""
    key = hashlib.sha256(json.dumps([FORMAT, table.classes, preprocessing(cfg)]).encode())
    for row, found in zip(table.rows, stamped or stamps(cfg, table), strict=True):
        key.update(f"{row.image}\0{row.label}\0{row.split}\0{found.size}\0{found.mtime_ns}\n".encode())
    folder = Path(os.environ[CACHE_ENV], "volumes") if os.environ.get(CACHE_ENV) else table.root / ".medsweep"
    name = os.fsencode(table.root.resolve().name)[:FOLDER_BYTES].decode(errors="ignore")  # 100 of 漢 are 300 bytes
    return folder / f"{NIFTI}_{name}_{cfg.size}_{key.hexdigest()[:16]}.npz"


def check(cfg: DataConfig) -> bool:
    """Whether the cache for ``cfg`` is built; refuses what :func:`ensure` would (the CSV, the files' headers), writing
    nothing."""
    table = read_table(cfg)
    stamped = stamps(cfg, table)
    if built(cache_path(cfg, table, stamped)):
        return True
    checked_headers(cfg, table, stamped)
    return False


def ensure(cfg: DataConfig) -> Path:
    """The cache for ``cfg``, built if missing from the files as their stamps name it."""
    table = read_table(cfg)
    stamped = stamps(cfg, table)
    path = cache_path(cfg, table, stamped)
    if not built(path):
        build(cfg, table, path, stamped)
    return path


def built(path: Path) -> bool:
    """Whether the cache ``path`` is there and reads, every array checked against its CRC; a corrupt one (cut short,
    overwritten, in part) is built again, a folder in its place refused."""
    try:
        if path.is_dir():
            raise UsageError(f"the cache {path} is a folder: remove it (data=nifti builds the cache in its place)")
        if not path.exists():
            return False
    except OSError as err:  # Path's checks raise for a name too long in CACHE_ENV, a folder that cannot be searched
        raise UsageError(
            f"cannot read the cache {path} ({err.strerror}): make {path.parent} a folder that can be read and "
            f"written, or set {CACHE_ENV}=<a writable folder> to keep it there"
        ) from None
    try:
        read_meta(path)
        with zipfile.ZipFile(path) as archive:  # every array's CRC: the meta reads in a file damaged before it
            damaged = archive.testzip()
        if damaged is not None:
            raise zipfile.BadZipFile(f"bad CRC-32 for {damaged}")
    except Exception as err:  # numpy, zipfile and json raise assorted errors on a bad file
        log.warning("the cache %s does not read (%s): building it again", path, err)
        return False
    return True


def checked_headers(cfg: DataConfig, table: Table, stamped: list[Stamp]) -> tuple[list[Header], list[float]]:
    """Every volume's header, checked (layout, size once resampled), and the spacing to resample to."""
    headers = [read_header(table, row, found) for row, found in zip(table.rows, stamped, strict=True)]
    check_layout(cfg, table, headers)
    spacing = cfg.spacing or median_spacing(table, headers)
    check_resampled(table, headers, spacing)
    return headers, spacing


def build(cfg: DataConfig, table: Table, path: Path, stamped: list[Stamp]) -> None:
    start = time.perf_counter()
    headers, spacing = checked_headers(cfg, table, stamped)
    try:  # before any voxel is read: a folder that cannot take the cache was found after the whole preprocessing
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as err:
        raise unwritable(path, err) from None
    log.info("preprocessing %d volumes of %s to %s mm, %d^3", len(table.rows), table.csv, spacing, cfg.size)
    done = cubes(cfg, spacing, table, headers, stamped)
    arrays = {}
    for split in SPLITS:
        picked = [i for i, row in enumerate(table.rows) if row.split == split]
        images = np.stack([done[i][0] for i in picked])
        arrays[f"{split}_images"] = images[:, 0] if cfg.in_channels == 1 else images
        arrays[f"{split}_labels"] = np.array([[table.rows[i].label] for i in picked], np.int64)
    digest = hashlib.md5(table.raw)  # the bytes the rows were read from
    for _, file_md5 in done:
        digest.update(file_md5.encode())
    meta = {
        "format": FORMAT,
        "digest": digest.hexdigest(),
        "root": str(table.root.resolve()),
        "labels": str(table.csv.resolve()),
        "classes": list(table.classes),
        "split_given": table.split_given,
        "spacing": list(spacing),
        "spacings": [[list(s), n] for s, n in collections.Counter(h.spacing for h in headers).most_common()],
        "images": {split: [row.image for row in table.split(split)] for split in SPLITS},
        "preprocessing": preprocessing(cfg),
    }
    try:
        write_npz(path, {**arrays, "meta": np.array(json.dumps(meta))}, compressed=False)
    except OSError as err:  # a read-only folder, a file named as the folder, a name too long
        raise unwritable(path, err) from None
    log.info("cached %s (%.1f MiB) in %.0f s", path, path.stat().st_size / 2**20, time.perf_counter() - start)


def unwritable(path: Path, err: OSError) -> UsageError:
    return UsageError(
        f"cannot write the cache {path} ({err.strerror}): make {path.parent} a writable folder, or set "
        f"{CACHE_ENV}=<a writable folder> to keep it there"
    )


def median_spacing(table: Table, headers: list[Header]) -> list[float]:
    """The training volumes' median voxel size along R, A, S."""
    train = [header.spacing for row, header in zip(table.rows, headers, strict=True) if row.split == "train"]
    return np.median(train, axis=0).round(4).tolist()


def read_meta(path: Path) -> dict[str, Any]:
    with np.load(path) as npz:
        return json.loads(str(npz["meta"]))
