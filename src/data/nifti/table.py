"""The labels CSV of ``data=nifti`` read against ``data.*``: each row's volume, class and split.

Columns ``image`` (relative to ``data.root``), ``label`` (a class name, or a class index 0..K-1) and, optionally,
``split`` (``train``/``val``/``test``). Without a split column each class is split by ``data.split_fractions``
(rounded, at least one volume per split) in an order seeded by ``data.split_seed``. Class order: ``data.classes``,
else the labels sorted (indices: themselves). The CSV is read once (:mod:`src.data.nifti.snapshot`): UTF-8, or the
encoding its byte-order mark names (UTF-16 and UTF-32, as spreadsheets save "Unicode"). Every refusal is one line naming
the CSV line and the fix.
"""

from __future__ import annotations

import codecs
import csv
import io
import os
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from src.config import SPLITS, TASKS, DataConfig
from src.data.nifti import snapshot
from src.errors import UsageError

COLUMNS = ("image", "label")  # required; "split" is optional
INDEX = re.compile(r"-?\d+")
BINARY, MULTI = TASKS
Records = list[tuple[int, dict[str, str]]]  # (CSV line, {column: stripped value}) per row
CSV_BYTES = 256 * 2**20  # the most a labels CSV may hold (a million rows take ~50 MiB)
BOMS = (  # UTF-32's before UTF-16's: FF FE 00 00 starts with FF FE
    (codecs.BOM_UTF32_LE, "utf-32", "UTF-32"),
    (codecs.BOM_UTF32_BE, "utf-32", "UTF-32"),
    (codecs.BOM_UTF8, "utf-8-sig", "UTF-8"),
    (codecs.BOM_UTF16_LE, "utf-16", "UTF-16"),
    (codecs.BOM_UTF16_BE, "utf-16", "UTF-16"),
)


@dataclass(frozen=True)
class Row:
    line: int  # its line in the CSV (the header is line 1)
    image: str  # as the CSV gives it
    path: Path
    label: int  # the class index
    split: str


@dataclass(frozen=True)
class Table:
    csv: Path
    root: Path
    classes: tuple[str, ...]
    rows: tuple[Row, ...]  # in the CSV's order
    split_given: bool  # the CSV's split column, not a seeded split
    # the CSV's bytes, as read once: the rows are theirs, the cache's digest starts there
    raw: bytes = field(repr=False)

    def split(self, name: str) -> list[Row]:
        return [row for row in self.rows if row.split == name]

    def sizes(self) -> dict[str, int]:
        return {name: len(self.split(name)) for name in SPLITS}

    def at(self, row: Row) -> str:
        """Where a row is, for a message."""
        return f"{self.csv} line {row.line}"


def labels_path(cfg: DataConfig) -> Path:
    return Path(cfg.labels or Path(cfg.root) / "labels.csv").expanduser()


def read_table(cfg: DataConfig) -> Table:
    """The CSV's rows with their class and split; refuses a CSV that does not fit ``cfg``."""
    root, path = Path(cfg.root).expanduser(), labels_path(cfg)
    if not os.path.isdir(root):  # False, not an error, for a name too long
        raise UsageError(f"data.root={cfg.root} is not a folder: set data.root=<the folder of the volumes>")
    records, raw = read_csv(path)
    check_images(cfg, path, root, records)
    classes, labels = class_indices(cfg, path, records)
    check_classes(cfg, path, classes)
    given = "split" in records[0][1]
    splits = given_splits(path, records, classes, labels) if given else stratified(cfg, path, classes, labels)
    rows = tuple(
        Row(line, record["image"], root / record["image"], label, split)
        for (line, record), label, split in zip(records, labels, splits, strict=True)
    )
    return Table(path, root, tuple(classes), rows, given, raw)


def read_csv(path: Path) -> tuple[Records, bytes]:
    """``(line, {column: stripped value})`` per row, and the bytes they were read from (once); the columns and empty
    cells checked."""
    try:
        read = snapshot.read(path, CSV_BYTES)  # a FIFO: refused, not read (it would block for ever)
    except FileNotFoundError:
        raise UsageError(
            f"{path} not found: write the labels CSV there (columns image,label and optionally split), "
            f"or set data.labels=<its path>"
        ) from None
    except snapshot.NotAFile:
        raise UsageError(f"{path} is not a file: write the labels CSV there, or set data.labels=<its path>") from None
    except snapshot.Changed as err:
        raise UsageError(f"{path} changed while it was read ({err}): run again once nothing writes to it") from None
    except OSError as err:
        raise UsageError(f"{path} is not a readable CSV ({err}): save it as UTF-8 text, one row per volume") from None
    if read.size > CSV_BYTES:
        raise UsageError(f"{path} holds more than {CSV_BYTES >> 20} MiB: a labels CSV is one short row per volume")
    raw = read.data.getvalue()
    reader = csv.DictReader(io.StringIO(decoded(path, raw), newline=""))
    try:
        header = [name.strip() for name in reader.fieldnames or []]
        records = [(reader.line_num, cells(row)) for row in reader]
    except csv.Error as err:
        raise UsageError(f"{path} is not a readable CSV ({err}): save it as UTF-8 text, one row per volume") from None
    repeated = sorted({name for name in header if name and header.count(name) > 1})
    if repeated:  # csv.DictReader would keep the last of them, silently (unnamed ones: a spreadsheet's)
        raise UsageError(
            f"{path} has columns {header}, {' and '.join(repeated)} more than once: keep one column of each name"
        )
    missing = [name for name in COLUMNS if name not in header]
    if missing:
        fix = (  # a spreadsheet's "Unicode text" is tab-separated
            "it reads as tab-separated: save it comma-separated"
            if len(header) == 1 and "\t" in header[0]
            else "start it with the header line image,label (or image,label,split)"
        )
        raise UsageError(f"{path} has columns {header}, not {' and '.join(missing)}: {fix}")
    if not records:
        raise UsageError(f"{path} has no rows: add one line image,label per volume")
    for line, record in records:
        for column in COLUMNS:
            if not record[column]:
                raise UsageError(f"{path} line {line}: no {column}: give every row an image and its label")
    return records, raw


def cells(row: dict[str | None, str | None]) -> dict[str, str]:
    """A row's cells by column, stripped; labels and splits in Unicode's composed form (NFC: ``é`` typed on one
    machine and decomposed on another, as macOS names files, are one class); images as written (a file's name is its
    bytes)."""
    found = {name.strip(): (value or "").strip() for name, value in row.items() if name is not None}
    return {name: value if name == "image" else unicodedata.normalize("NFC", value) for name, value in found.items()}


def decoded(path: Path, raw: bytes) -> str:
    """``raw`` as text: UTF-8, or the encoding its byte-order mark names; text that is not, or holds NUL characters
    (UTF-16 without its mark reads as UTF-8 with a NUL after each letter), refused naming the encoding."""
    encoding, name = next(((codec, name) for bom, codec, name in BOMS if raw.startswith(bom)), ("utf-8", None))
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as err:
        line = raw[: err.start].decode(encoding, errors="replace").count("\n") + 1
        named = f"{name} text, as its byte-order mark says" if name else "UTF-8 text"
        raise UsageError(
            f"{path} is not {named} (byte 0x{raw[err.start]:02x} on line {line}): save it as UTF-8"
        ) from None
    if "\0" in text:
        line = text[: text.index("\0")].count("\n") + 1
        raise UsageError(
            f"{path} holds NUL characters (line {line}): it is UTF-16 or UTF-32 without a byte-order mark, or not "
            f"text: save it as UTF-8"
        )
    return text


def check_images(cfg: DataConfig, path: Path, root: Path, records: Records) -> None:
    """Each image a path inside ``data.root`` (relative, or absolute through the folder or its real path; no ``..``
    out of it: a CSV from elsewhere names no file of the machine's, while a link inside the folder may lead anywhere)
    and one row per volume: two rows naming one file (``c0.nii.gz``, ``./c0.nii.gz``, a link to it) refused."""
    seen: dict[str, tuple[int, str]] = {}
    for line, record in records:
        image = record["image"]
        if not inside(root / image, root):
            raise UsageError(
                f"{path} line {line}: image {image} is outside data.root={cfg.root}: give a path inside the folder "
                f"(a link there may lead elsewhere), or set data.root to a folder that holds it"
            )
        first, spelled = seen.setdefault(os.path.realpath(root / image), (line, image))  # no error on a link loop
        if first != line:
            also = f" (as {spelled})" if spelled != image else ""
            raise UsageError(f"{path} line {line}: {image} is on line {first}{also} too: one row per volume")


def inside(path: Path, root: Path) -> bool:
    """Whether ``path`` is in ``root`` as written (``..`` taken lexically: a link inside stays inside), or once both
    are resolved (an absolute path through the folder's real location)."""
    for resolve in (os.path.abspath, os.path.realpath):  # realpath: no error on a link loop
        folder = resolve(root)
        if os.path.commonpath([resolve(path), folder]) == folder:
            return True
    return False


def class_indices(cfg: DataConfig, path: Path, records: Records) -> tuple[list[str], list[int]]:
    """The class names in class order and each row's class index."""
    labels = [(line, record["label"]) for line, record in records]
    given = [unicodedata.normalize("NFC", name) for name in cfg.classes or []]  # as the labels are
    if given and all(label in given for _, label in labels):  # names, also those that read as indices:
        lookup = {name: k for k, name in enumerate(given)}  # data.classes=[1,0] puts the rows labelled 1 first
        return given, [lookup[label] for _, label in labels]
    named = [(line, label) for line, label in labels if not INDEX.fullmatch(label)]
    if named and len(named) < len(labels):
        (line, name), (index_line, index) = named[0], next(item for item in labels if INDEX.fullmatch(item[1]))
        raise UsageError(
            f"{path} line {line}: label {name!r} is a name but line {index_line}'s {index} is a class index: "
            f"use class names throughout, or indices 0..K-1 throughout"
        )
    if named:
        classes = given or sorted({label for _, label in labels})
        lookup = {name: k for k, name in enumerate(classes)}
        for line, label in labels:
            if label not in lookup:
                raise UsageError(
                    f"{path} line {line}: label {label!r} is not a class of data.classes={classes}: "
                    f"fix the row, or add its class to data.classes"
                )
        return classes, [lookup[label] for _, label in labels]
    indices = [int(label) for _, label in labels]
    classes = given or index_classes(path, labels, indices)
    for (line, _), index in zip(labels, indices, strict=True):
        if not 0 <= index < len(classes):
            raise UsageError(
                f"{path} line {line}: label {index} is not a class: class indices are 0..{len(classes) - 1}"
                f"{' (data.classes)' if cfg.classes else ''}: fix the row"
            )
    return classes, indices


def index_classes(path: Path, labels: list[tuple[int, str]], indices: list[int]) -> list[str]:
    """``0``, ``1``... up to the largest index; one past the rows (a class with no row) refused before the list of
    names is made (an index of 10^9 would fill the memory)."""
    top = max(indices)
    if top >= len(indices):
        line = labels[indices.index(top)][0]
        raise UsageError(
            f"{path} line {line}: label {top} is not a class: class indices are 0..K-1, each with rows, and the CSV's "
            f"{len(indices)} rows hold at most {len(indices)} classes (0..{len(indices) - 1}): fix the row"
        )
    return [str(k) for k in range(top + 1)]


def check_classes(cfg: DataConfig, path: Path, classes: list[str]) -> None:
    """``data.num_classes`` and ``data.task`` against the CSV's classes."""
    k, listed = len(classes), ", ".join(classes)
    if k < 2:
        raise UsageError(f"{path} holds one class ({listed}): a classifier needs rows of 2 or more classes")
    task = BINARY if k == 2 else MULTI
    if (cfg.num_classes, cfg.task) != (k, task):
        raise UsageError(
            f"data.num_classes={cfg.num_classes} data.task={cfg.task} do not fit {path}: it holds {k} classes "
            f"({listed}): set data.num_classes={k} data.task={task}"
        )


def given_splits(path: Path, records: Records, classes: list[str], labels: list[int]) -> list[str]:
    """The split column, checked: known values, every split present, every class in each split (a class without
    train rows is never learnt; without val or test rows, its AUC there is undefined and model selection blind to
    it)."""
    splits = [record["split"] for _, record in records]
    for (line, _), split in zip(records, splits, strict=True):
        if split not in SPLITS:
            raise UsageError(
                f"{path} line {line}: split {split!r} is not train, val or test: fix it, or drop the split column "
                f"(a seeded split by data.split_fractions)"
            )
    for name in SPLITS:
        if name not in splits:
            raise UsageError(f"{path} has no {name} rows: mark some rows {name} in its split column")
    for split in SPLITS:
        present = {label for label, named in zip(labels, splits, strict=True) if named == split}
        for k, name in enumerate(classes):
            if k not in present:
                raise UsageError(
                    f"{path}: class {name!r} has no {split} row: mark some of its rows {split}, or drop the split "
                    f"column (a seeded split by data.split_fractions puts every class in each)"
                )
    return splits


def stratified(cfg: DataConfig, path: Path, classes: list[str], labels: list[int]) -> list[str]:
    """Each class split by ``data.split_fractions`` (val and test rounded, at least one each; train the rest, at
    least one), its rows in an order seeded by ``data.split_seed``."""
    rng = np.random.default_rng(cfg.split_seed)
    splits = np.empty(len(labels), dtype=object)
    labels_array = np.asarray(labels)
    for k, name in enumerate(classes):
        members = rng.permutation(np.flatnonzero(labels_array == k))
        val, test = (max(1, round(len(members) * fraction)) for fraction in cfg.split_fractions[1:])
        if len(members) < val + test + 1:
            raise UsageError(
                f"{path}: class {name!r} has {len(members)} volume{'s' if len(members) != 1 else ''}, too few to "
                f"split into train, val and test by data.split_fractions={cfg.split_fractions}: add volumes of it, "
                f"or give the CSV a split column"
            )
        splits[members[:val]], splits[members[val : val + test]], splits[members[val + test :]] = "val", "test", "train"
    return splits.tolist()
