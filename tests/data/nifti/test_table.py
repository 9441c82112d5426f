"""The labels CSV read against ``data.*`` (:mod:`src.data.nifti.table`): class indices, ``data.classes``'s order,
a split by fractions and seed without a split column."""

from __future__ import annotations

import torch

from src.data.files import class_names, npz_path, split_sizes
from src.data.loaders import load_splits
from src.data.nifti.cache import ensure, read_meta
from tests.data.nifti.folders import folder, nifti


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
