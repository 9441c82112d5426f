"""NIfTI folders for the tests, written by nibabel in temp dirs: volumes of noise and their labels CSV, the typed
``data`` of ``data=nifti`` on them, and every bad input's folder with the start of its one line."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import nibabel as nib
import numpy as np
from omegaconf import OmegaConf

from tests.helpers import compose_config

CSV = "labels.csv"


def nifti(root: Path, *overrides: str):
    """The typed ``data`` of ``data=nifti data.root=<root>`` and ``overrides``, composed by Hydra."""
    return OmegaConf.to_object(compose_config("data=nifti", f"data.root={root}", *overrides)).data


def save(path: Path, volume: np.ndarray, affine: np.ndarray | None = None) -> Path:
    nib.save(nib.Nifti1Image(volume.astype(np.float32), np.eye(4) if affine is None else affine), path)
    return path


def write_csv(root: Path, rows: list[tuple], header: str = "image,label,split") -> Path:
    (root / CSV).write_text("\n".join([header, *(",".join(map(str, row)) for row in rows)]) + "\n")
    return root / CSV


def with_sform(path: Path, affine: np.ndarray) -> None:
    """``path``'s voxels saved again under the sform ``affine`` alone (nibabel's constructor refuses a degenerate
    one; its header takes it)."""
    image = nib.Nifti1Image(np.asarray(nib.load(path).dataobj), None)
    image.header.set_sform(affine, code=1)
    nib.save(image, path)


def spoil_gzip(path: Path, how: str) -> None:
    """``path``'s gzip stream damaged as ``how`` says, its start intact: nibabel reads the header and, reading no
    further than the voxels it needs, the voxels too; only the whole stream shows the damage."""
    raw = path.read_bytes()
    if how == "crc":  # the trailer's CRC-32 of the data
        raw = raw[:-8] + bytes([raw[-8] ^ 0xFF]) + raw[-7:]
    elif how == "isize":  # the trailer's length of the data
        raw = raw[:-1] + bytes([raw[-1] ^ 0x01])
    elif how == "voxels-under-the-old-trailer":  # a voxel changed, the stream rewritten, the old CRC and length kept
        data = bytearray(gzip.decompress(raw))
        data[-10] ^= 0x40
        raw = gzip.compress(bytes(data))[:-8] + raw[-8:]
    elif how == "trailing-garbage":
        raw += b"garbage!"
    elif how == "cut-short":
        raw = raw[: len(raw) // 2]
    path.write_bytes(raw)


def noise(seed: int, shape: tuple[int, ...] = (12, 12, 12)) -> np.ndarray:
    return np.random.default_rng(seed).normal(100, 30, shape)


def folder(root: Path, rows: list[tuple], header: str = "image,label,split", shape=(12, 12, 12)) -> Path:
    """A volume of noise per row (the rows' first column names it) and the CSV of ``rows``."""
    root.mkdir(parents=True, exist_ok=True)
    for seed, row in enumerate(rows):
        save(root / row[0], noise(seed, shape))
    write_csv(root, rows, header)
    return root


def six(root: Path, header: str = "image,label,split") -> Path:
    """Two classes, one volume of each in each split."""
    splits = ("train", "val", "test")
    return folder(root, [(f"{c}{i}.nii.gz", c, s) for i, s in enumerate(splits) for c in "ab"], header)


def bad_cases(root: Path) -> dict[str, tuple[tuple[str, ...], str]]:
    """Each case's overrides and the start of its one line; ``root`` prepared by :func:`prepare`."""
    csv = root / CSV
    return {
        "no-root": (("data.root=/nonexistent/scans",), "data.root=/nonexistent/scans is not a folder: set data.root="),
        "no-csv": (("data.labels=/nonexistent/labels.csv",), "/nonexistent/labels.csv not found: write the labels CSV"),
        "long-csv": ((f"data.labels={root}/{'x' * 300}.csv",), f"{root}/{'x' * 300}.csv is not a readable CSV (["),
        "columns": ((), f"{csv} has columns ['image', 'class', 'split'], not label: start it with the header line"),
        "missing-file": ((), f"{csv} line 3: cannot read {root / 'gone.nii.gz'} (No such file or directory): fix"),
        "unreadable": ((), f"{csv} line 2: {root / 'a0.nii.gz'} is not a volume nibabel reads ("),
        "not-a-class": (("data.classes=[a,b]",), f"{csv} line 4: label 'c' is not a class of data.classes=['a', 'b']"),
        "index-range": (("data.classes=[a,b]",), f"{csv} line 7: label 2 is not a class: class indices are 0..1"),
        "names-and-indices": ((), f"{csv} line 2: label 'a' is a name but line 7's 1 is a class index: use class"),
        "no-train-row": ((), f"{csv}: class 'b' has no train row: mark some of its rows train"),
        "bad-split": ((), f"{csv} line 5: split 'validation' is not train, val or test: fix it"),
        "empty-split": ((), f"{csv} has no test rows: mark some rows test"),
        "repeated": ((), f"{csv} line 7: a2.nii.gz is on line 6 too: one row per volume"),
        "repeated-spelt-otherwise": ((), f"{csv} line 7: ./a2.nii.gz is on line 6 (as a2.nii.gz) too: one row per"),
        "huge-index": (
            (),
            f"{csv} line 3: label 99999999999999999999 is not a class: class indices are 0..K-1, each with rows, and "
            f"the CSV's 6 rows hold at most 6 classes (0..5): fix the row",
        ),
        "zero-affine": ((), f"{csv} line 2: {root / 'a0.nii.gz'} has a degenerate affine (voxel sizes [0.0, 0.0, 0.0]"),
        "parallel-axes": ((), f"{csv} line 3: {root / 'b0.nii.gz'} has a degenerate affine (voxel sizes [1.0, 1.0,"),
        "nan-origin": ((), f"{csv} line 2: {root / 'a0.nii.gz'} has NaN or infinite numbers in its affine ([[1.0,"),
        "tiny-voxels": (
            (),
            f"{csv} line 4: a1.nii.gz (1 x 1 x 1 mm voxels) resampled to [0.001, 0.001, 0.001] mm would be 12000 x "
            f"12000 x 12000 voxels, more than 1073741824: set data.spacing to larger voxels, or fix the voxel sizes",
        ),
        "long-root": ((f"data.root={root}/{'x' * 300}",), f"data.root={root}/{'x' * 300} is not a folder: set"),
        "too-few": ((), f"{csv}: class 'b' has 2 volumes, too few to split into train, val and test"),
        "num-classes": (
            (),
            f"data.num_classes=2 data.task=binary-class do not fit {csv}: it holds 3 classes (a, b, c): "
            f"set data.num_classes=3 data.task=multi-class",
        ),
        "one-class": ((), f"{csv} holds one class (a): a classifier needs rows of 2 or more classes"),
        "four-d": ((), f"{csv} line 2: a0.nii.gz (12, 12, 12, 3) has 3 channels, expected data.in_channels=1: set "),
        "two-d": ((), f"{csv} line 2: a0.nii.gz is 2-D (12, 12): give 3-D volumes, or 4-D with the channels last"),
        "mixed": (
            (),
            f"{csv}: volumes of mixed dimensionality: a0.nii.gz (line 2) is 3-D (12, 12, 12), b0.nii.gz (line 3)",
        ),
        "no-voxels": ((), f"{csv} line 3: b0.nii.gz holds no voxels (shape (12, 0, 12)): replace it, or drop the row"),
        "complex": (
            (),
            f"{csv} line 3: b0.nii.gz holds complex64 voxels, not real numbers: save it as real values (the magnitude",
        ),
        "fifo-volume": ((), f"{csv} line 3: {root / 'b0.nii.gz'} is not a file: put the volume there, or remove"),
        "fifo-csv": ((), f"{csv} is not a file: write the labels CSV there, or set data.labels=<its path>"),
        "utf16-without-bom": (
            (),
            f"{csv} holds NUL characters (line 1): it is UTF-16 or UTF-32 without a byte-order mark, or not text: "
            "save it as UTF-8",
        ),
        "latin1": ((), f"{csv} is not UTF-8 text (byte 0xe9 on line 3): save it as UTF-8"),
        "nul": ((), f"{csv} holds NUL characters (line 3): it is UTF-16 or UTF-32 without a byte-order mark"),
        "tab-separated": ((), f"{csv} has columns ['image\\tlabel\\tsplit'], not image and label: it reads as "),
        "no-val-class": ((), f"{csv}: class 'b' has no val row: mark some of its rows val"),
        "no-test-class": ((), f"{csv}: class 'a' has no test row: mark some of its rows test"),
        "outside-root": ((), f"{csv} line 2: image a0/../../outside.nii.gz is outside data.root={root}: give a path"),
        "absolute": ((), f"{csv} line 3: image /etc/passwd is outside data.root={root}: give a path"),
        "nii-cut-short": (
            (),
            f"{csv} line 5: {root / 'b1.nii'} is cut short: its header implies 7264 bytes, the file holds 7164: "
            "replace it, or drop the row",
        ),
        "pair": ((), f"{csv} line 2: {root / 'a0.img'} is a Nifti1Pair, not a volume in one file (NIfTI .nii or "),
        "hard-link": ((), f"{csv} line 7: b2.nii.gz is line 2's file (a0.nii.gz, a hard link to it) too: one row per"),
        "repeated-column": (
            (),
            f"{csv} has columns ['image', 'label', 'label', '', ''], label more than once: keep one column of each "
            "name",
        ),
    }


def moved(rows: list[list[str]], split: str, to: str, label: str | None = None) -> list[list[str]]:
    """``rows`` with those of ``split`` (of class ``label`` only, where given) moved to split ``to``."""
    return [[image, lab, to if (at, lab) == (split, label or lab) else at] for image, lab, at in rows]


def prepare(root: Path, case: str) -> None:
    """``root``: six good volumes (a and b, one of each per split), spoiled as ``case`` says."""
    six(root)
    rows = [line.split(",") for line in (root / CSV).read_text().split()[1:]]
    if case == "columns":
        write_csv(root, rows, header="image,class,split")
    elif case == "missing-file":
        write_csv(root, [rows[0], ["gone.nii.gz", "b", "train"], *rows[2:]])
    elif case == "unreadable":
        (root / "a0.nii.gz").write_bytes(b"not a volume")
    elif case in ("not-a-class", "num-classes"):
        write_csv(root, [*rows[:2], [rows[2][0], "c", "val"], *rows[3:]])
    elif case == "index-range":
        write_csv(
            root, [[image, int(label == "b") if i < 5 else 2, split] for i, (image, label, split) in enumerate(rows)]
        )
    elif case == "names-and-indices":
        write_csv(root, [*rows[:5], [rows[5][0], 1, "test"]])
    elif case == "no-train-row":
        write_csv(root, moved(rows, "train", "val", label="b"))
    elif case == "bad-split":
        write_csv(root, [*rows[:3], [rows[3][0], "b", "validation"], *rows[4:]])
    elif case == "empty-split":
        write_csv(root, moved(rows, "test", "val"))
    elif case == "repeated":
        write_csv(root, [*rows[:5], [rows[4][0], "a", "test"]])
    elif case == "repeated-spelt-otherwise":
        write_csv(root, [*rows[:5], [f"./{rows[4][0]}", "b", "test"]])
    elif case == "huge-index":
        huge = {0: 10**9, 1: 10**20 - 1}
        write_csv(
            root, [[image, huge.get(i, int(label == "b")), split] for i, (image, label, split) in enumerate(rows)]
        )
    elif case == "zero-affine":
        with_sform(root / "a0.nii.gz", np.zeros((4, 4)))
    elif case == "nan-origin":  # voxel sizes fine: the cube came out blank
        with_sform(root / "a0.nii.gz", np.array([[1, 0, 0, np.nan], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]))
    elif case == "parallel-axes":
        with_sform(root / "b0.nii.gz", np.array([[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]))
    elif case == "tiny-voxels":  # the training median 0.001 mm: the other volumes 1000x on each side
        for image in ("a0.nii.gz", "b0.nii.gz"):
            save(root / image, noise(0), np.diag([0.001, 0.001, 0.001, 1]))
    elif case == "too-few":
        folder(
            root, [(f"a{i}.nii.gz", "a") for i in range(5)] + [("b0.nii.gz", "b"), ("b1.nii.gz", "b")], "image,label"
        )
    elif case == "one-class":
        write_csv(root, [[image, "a", split] for image, _, split in rows])
    elif case == "four-d":
        save(root / "a0.nii.gz", noise(0, (12, 12, 12, 3)))
    elif case == "two-d":
        for image, _, _ in rows:
            save(root / image, noise(0, (12, 12)))
    elif case == "mixed":
        save(root / "b0.nii.gz", noise(0, (12, 12)))
    elif case == "no-voxels":
        save(root / "b0.nii.gz", noise(0, (12, 0, 12)))
    elif case == "complex":  # MONAI would keep the real part, with a warning
        nib.save(nib.Nifti1Image(noise(0).astype(np.complex64), np.eye(4)), root / "b0.nii.gz")
    elif case in ("fifo-volume", "fifo-csv"):  # a read would block for ever
        path = root / ("b0.nii.gz" if case == "fifo-volume" else CSV)
        path.unlink()
        os.mkfifo(path)
    elif case == "utf16-without-bom":  # as Windows' "Unicode" without its BOM
        (root / CSV).write_bytes((root / CSV).read_text().encode("utf-16-le"))
    elif case == "latin1":  # a spreadsheet's "CSV" in Windows-1252
        (root / CSV).write_bytes((root / CSV).read_bytes().replace(b"b0.nii.gz,b,", b"b0.nii.gz,b\xe9,"))
    elif case == "nul":  # a path with a NUL: os.stat raised ValueError
        (root / CSV).write_bytes((root / CSV).read_bytes().replace(b"b0.nii.gz", b"b0.nii.gz\0"))
    elif case == "tab-separated":  # as a spreadsheet's "Unicode text": UTF-16 with its BOM (read), tabs between cells
        (root / CSV).write_bytes((root / CSV).read_text().replace(",", "\t").encode("utf-16"))
    elif case == "no-val-class":
        write_csv(root, moved(rows, "val", "train", label="b"))
    elif case == "no-test-class":
        write_csv(root, moved(rows, "test", "val", label="a"))
    elif case == "outside-root":  # a CSV from elsewhere naming a file outside the folder
        write_csv(root, [["a0/../../outside.nii.gz", "a", "train"], *rows[1:]])
    elif case == "absolute":
        write_csv(root, [rows[0], ["/etc/passwd", "b", "train"], *rows[2:]])
    elif case == "nii-cut-short":  # uncompressed: the file's size says it, before any voxel is read
        for image, _, _ in rows:
            save(root / image.removesuffix(".gz"), noise(0))
        write_csv(root, [[image.removesuffix(".gz"), label, split] for image, label, split in rows])
        whole = (root / "b1.nii").read_bytes()
        (root / "b1.nii").write_bytes(whole[:-100])
    elif case == "pair":  # two files: one cannot be read once, whole, and checked unchanged
        nib.save(nib.Nifti1Pair(noise(0).astype(np.float32), np.eye(4)), root / "a0.img")
        write_csv(root, [["a0.img", "a", "train"], *rows[1:]])
    elif case == "hard-link":  # a0's voxels in test too (a symlink resolves to one path; this does not)
        (root / "b2.nii.gz").unlink()
        os.link(root / "a0.nii.gz", root / "b2.nii.gz")
    elif case == "repeated-column":  # csv.DictReader would keep the last: the splits as labels
        write_csv(root, [[*row, "", ""] for row in rows], header="image,label,label,,")  # unnamed ones are no repeat


CASES = list(bad_cases(Path("/")))
