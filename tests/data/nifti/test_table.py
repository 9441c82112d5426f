"""The labels CSV read against ``data.*`` (:mod:`src.data.nifti.table`): class indices, ``data.classes``'s order,
a split by fractions and seed without a split column."""

from __future__ import annotations

import os

import pytest
import torch

from src.data.files import class_names, npz_path, split_sizes
from src.data.loaders import load_splits
from src.data.nifti.cache import ensure, read_meta
from src.data.nifti.table import read_table
from tests.data.helpers import refusal
from tests.data.nifti.folders import CSV, folder, nifti, six


def test_integer_labels_are_class_indices(tmp_path):
    rows = [(f"v{i}.nii.gz", i % 3, ("train", "val", "test")[i // 3]) for i in range(9)]
    cfg = nifti(folder(tmp_path, rows), "data.num_classes=3", "data.task=multi-class")
    assert class_names(cfg) == ["0", "1", "2"]
    assert load_splits(cfg)["train"][1].tolist() == [0, 1, 2]


def test_labels_that_are_all_in_data_classes_are_its_names_even_digits(tmp_path):
    """``data.classes=[1,0]`` on labels 1 and 0 names the order of those labels: read as indices, the rows labelled 1
    would be class 1, named "0"."""
    rows = [(f"v{i}.nii.gz", i % 2, ("train", "val", "test")[i // 2]) for i in range(6)]
    cfg = nifti(folder(tmp_path, rows), "data.classes=[1,0]")
    assert class_names(cfg) == ["1", "0"]
    assert load_splits(cfg)["train"][1].tolist() == [1, 0]  # v0 labelled 0, v1 labelled 1
    assert class_names(nifti(tmp_path, "data.classes=[normal,tumour]")) == ["normal", "tumour"]  # indices, named


def test_without_a_split_column_each_class_is_split_by_the_fractions_and_seed(tmp_path):
    folder(tmp_path, [(f"v{i}.nii.gz", "ab"[i % 2]) for i in range(40)], header="image,label")
    cfg = nifti(tmp_path, "data.size=16")
    assert split_sizes(cfg) == {"train": 28, "val": 4, "test": 8}  # 0.7/0.1/0.2 of each class of 20
    labels = {split: tensors[1] for split, tensors in load_splits(cfg).items()}
    assert {split: torch.bincount(y).tolist() for split, y in labels.items()} == {
        "train": [14, 14],
        "val": [2, 2],
        "test": [4, 4],
    }
    images = read_meta(npz_path(cfg))["images"]
    assert images == read_meta(npz_path(nifti(tmp_path, "data.size=16")))["images"]  # the same seed, the same split
    assert images != read_meta(ensure(nifti(tmp_path, "data.size=16", "data.split_seed=1")))["images"]
    assert sorted(sum(images.values(), [])) == sorted(f"v{i}.nii.gz" for i in range(40))


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-be-bom", "utf-32"])
def test_a_csv_with_a_byte_order_mark_reads_as_its_utf8_text(tmp_path, encoding):
    """A spreadsheet's "CSV UTF-8" (a BOM) and "Unicode" (UTF-16 with a BOM): the mark says the encoding."""
    six(tmp_path)
    cfg = nifti(tmp_path, "data.size=16")
    utf8 = read_table(cfg)
    text = (tmp_path / CSV).read_text()
    raw = ("\ufeff" + text).encode("utf-16-be") if encoding == "utf-16-be-bom" else text.encode(encoding)
    (tmp_path / CSV).write_bytes(raw)
    table = read_table(cfg)
    assert (table.classes, table.rows) == (utf8.classes, utf8.rows)
    assert table.raw == raw  # the bytes read, which the cache's digest is of


def test_class_names_that_read_as_spreadsheet_formulas_are_kept_as_names(tmp_path):
    """The CSV is data: ``=cmd|...`` is a class name here (what medsweep writes to CSV files is escaped there)."""
    rows = [(f"v{i}.nii.gz", ("=1+1", "@sum")[i % 2], ("train", "val", "test")[i // 2]) for i in range(6)]
    assert class_names(nifti(folder(tmp_path, rows))) == ["=1+1", "@sum"]


def test_an_absolute_path_into_the_folder_is_inside_it_and_the_same_volume_as_its_relative_one(tmp_path):
    """Scripts write full paths; through the folder's real location too (``data.root`` a link to it)."""
    six(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "link")
    text = (tmp_path / "real" / CSV).read_text()
    (tmp_path / "real" / CSV).write_text(text.replace("a0.nii.gz", str(tmp_path / "real" / "a0.nii.gz")))
    assert read_table(nifti(tmp_path / "link")).rows[0].path.samefile(tmp_path / "real" / "a0.nii.gz")
    (tmp_path / "real" / CSV).write_text(text + f"{tmp_path / 'link' / 'a0.nii.gz'},a,test\n")
    assert refusal(read_table, nifti(tmp_path / "link")).endswith("is on line 2 (as a0.nii.gz) too: one row per volume")


def test_a_label_composed_on_one_machine_and_decomposed_on_another_is_one_class(tmp_path):
    """``é`` as one code point (NFC) and as ``e`` and an accent (NFD, as macOS names files) read as 3 classes, two of
    them printed alike."""
    composed, decomposed = "b\u00e9nin", "be\u0301nin"
    rows = [
        (f"v{i}.nii.gz", (composed, decomposed, "malin")[i % 3], ("train", "val", "test")[i // 3]) for i in range(9)
    ]
    assert class_names(nifti(folder(tmp_path, rows))) == [composed, "malin"]
    assert class_names(nifti(tmp_path, f"data.classes=[malin,'{decomposed}']")) == ["malin", composed]
