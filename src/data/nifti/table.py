"""The labels CSV of ``data=nifti`` read against ``data.*``: each row's volume, class and split.

Columns ``image`` (relative to ``data.root``), ``label`` (a class name, or a class index 0..K-1) and, optionally,
``split`` (``train``/``val``/``test``). Without a split column each class is split by ``data.split_fractions``
(rounded, at least one volume per split) in an order seeded by ``data.split_seed``. Class order: ``data.classes``,
else the labels sorted (indices: themselves). Every refusal is one line naming the CSV line and the fix.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from src.config import SPLITS, TASKS, DataConfig
from src.errors import UsageError

COLUMNS = ("image", "label")  # required; "split" is optional
INDEX = re.compile(r"-?\d+")
BINARY, MULTI = TASKS
Records = list[tuple[int, dict[str, str]]]  # (CSV line, {column: stripped value}) per row


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
    records = read_csv(path)
    check_repeated(path, root, records)
    classes, labels = class_indices(cfg, path, records)
    check_classes(cfg, path, classes)
    given = "split" in records[0][1]
    splits = given_splits(path, records, classes, labels) if given else stratified(cfg, path, classes, labels)
    rows = tuple(
        Row(line, record["image"], root / record["image"], label, split)
        for (line, record), label, split in zip(records, labels, splits, strict=True)
    )
    return Table(path, root, tuple(classes), rows, given)


def read_csv(path: Path) -> Records:
    """``(line, {column: stripped value})`` per row; the columns and empty cells checked."""
    # os.path's checks, not Path's: False, not an OSError, for a name too long (the open below names it)
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block the read for ever
        raise UsageError(f"{path} is not a file: write the labels CSV there, or set data.labels=<its path>")
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            header = [name.strip() for name in reader.fieldnames or []]
            repeated = sorted({name for name in header if name and header.count(name) > 1})
            if repeated:  # csv.DictReader would keep the last of them, silently (unnamed ones: a spreadsheet's)
                raise UsageError(
                    f"{path} has columns {header}, {' and '.join(repeated)} more than once: "
                    f"keep one column of each name"
                )
            missing = [name for name in COLUMNS if name not in header]
            if missing:
                raise UsageError(
                    f"{path} has columns {header}, not {' and '.join(missing)}: "
                    f"start it with the header line image,label (or image,label,split)"
                )
            records = [
                (reader.line_num, {k.strip(): (v or "").strip() for k, v in row.items() if k is not None})
                for row in reader
            ]
    except FileNotFoundError:
        raise UsageError(
            f"{path} not found: write the labels CSV there (columns image,label and optionally split), "
            f"or set data.labels=<its path>"
        ) from None
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise UsageError(f"{path} is not a readable CSV ({err}): save it as UTF-8 text, one row per volume") from None
    if not records:
        raise UsageError(f"{path} has no rows: add one line image,label per volume")
    for line, record in records:
        for column in COLUMNS:
            if not record[column]:
                raise UsageError(f"{path} line {line}: no {column}: give every row an image and its label")
    return records


def check_repeated(path: Path, root: Path, records: Records) -> None:
    """One row per volume: two rows naming one file (``c0.nii.gz``, ``./c0.nii.gz``, a link to it) refused."""
    seen: dict[str, tuple[int, str]] = {}
    for line, record in records:
        image = record["image"]
        first, spelled = seen.setdefault(os.path.realpath(root / image), (line, image))  # no error on a link loop
        if first != line:
            also = f" (as {spelled})" if spelled != image else ""
            raise UsageError(f"{path} line {line}: {image} is on line {first}{also} too: one row per volume")


def class_indices(cfg: DataConfig, path: Path, records: Records) -> tuple[list[str], list[int]]:
    """The class names in class order and each row's class index."""
    labels = [(line, record["label"]) for line, record in records]
    if cfg.classes and all(label in cfg.classes for _, label in labels):  # names, also those that read as indices:
        lookup = {name: k for k, name in enumerate(cfg.classes)}  # data.classes=[1,0] puts the rows labelled 1 first
        return list(cfg.classes), [lookup[label] for _, label in labels]
    named = [(line, label) for line, label in labels if not INDEX.fullmatch(label)]
    if named and len(named) < len(labels):
        (line, name), (index_line, index) = named[0], next(item for item in labels if INDEX.fullmatch(item[1]))
        raise UsageError(
            f"{path} line {line}: label {name!r} is a name but line {index_line}'s {index} is a class index: "
            f"use class names throughout, or indices 0..K-1 throughout"
        )
    if named:
        classes = cfg.classes or sorted({label for _, label in labels})
        lookup = {name: k for k, name in enumerate(classes)}
        for line, label in labels:
            if label not in lookup:
                raise UsageError(
                    f"{path} line {line}: label {label!r} is not a class of data.classes={classes}: "
                    f"fix the row, or add its class to data.classes"
                )
        return classes, [lookup[label] for _, label in labels]
    indices = [int(label) for _, label in labels]
    classes = cfg.classes or index_classes(path, labels, indices)
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
    """The split column, checked: known values, every split present, every class in ``train``."""
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
    trained = {label for label, split in zip(labels, splits, strict=True) if split == "train"}
    for k, name in enumerate(classes):
        if k not in trained:
            raise UsageError(f"{path}: class {name!r} has no train row: mark some of its rows train")
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
