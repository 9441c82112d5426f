"""The file a config trains on (:mod:`src.data.files`): checked without a write, made where it can be, one line for a
path that is no file, cannot be read or cannot be written; the classes and split sizes of each kind, and a NIfTI
folder's content in the config's params."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from src.config import DataConfig
from src.data.files import check_file, class_names, content_params, ensure_file, npz_path, split_sizes
from src.data.loaders import load_splits
from src.errors import UsageError
from tests.data.helpers import REGENERATE, adrenal, refusal, synthetic
from tests.data.nifti.folders import nifti, noise, save, six
from tests.helpers import compose_config


def tree(root: Path) -> dict[Path, int]:
    return {path: path.stat().st_mtime_ns for path in root.rglob("*")}


def test_check_file_writes_nothing(tmp_path, shared_data):
    shutil.copy(shared_data / "vesselmnist3d.npz", tmp_path / "adrenalmnist3d.npz")
    before = tree(tmp_path)
    assert not check_file(adrenal(tmp_path / "cache"))  # missing: ensure_file would download it
    assert not check_file(synthetic(tmp_path / "cache"))  # missing: ensure_file would generate it
    with pytest.raises(UsageError):
        check_file(adrenal(tmp_path))
    assert tree(tmp_path) == before


def test_a_fifo_in_place_of_the_file_is_refused_not_read(tmp_path):
    """Reading a FIFO blocks until a writer comes: the command hung, deaf to SIGTERM."""
    cfg = synthetic(tmp_path)
    npz_path(cfg).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(npz_path(cfg))
    assert refusal(check_file, cfg) == f"{npz_path(cfg)} is not a file: {REGENERATE}"


def test_a_data_root_of_a_name_too_long_is_one_line(tmp_path):
    """Path.exists raised ENAMETOOLONG: a traceback."""
    cfg = synthetic(tmp_path / ("x" * 300))
    assert refusal(check_file, cfg) == (
        f"cannot read {npz_path(cfg)} (File name too long): set data.root=<a folder that can be read>"
    )


def test_a_data_root_that_is_a_file_is_one_usage_error(tmp_path):
    """It was FileExistsError from the download's mkdir: a traceback, exit 1."""
    root = tmp_path / "a-file"
    root.write_text("")
    cfg = DataConfig(name="vesselmnist3d", root=str(root), num_classes=2, task="binary-class")
    with pytest.raises(UsageError, match=r"^data.root=.*a-file cannot be written \(File exists\): give a folder"):
        ensure_file(cfg)


def test_classes_from_the_csv_reach_class_names_and_split_sizes(tmp_path):
    cfg = nifti(six(tmp_path))
    assert class_names(cfg) == ["a", "b"] and split_sizes(cfg) == {"train": 2, "val": 2, "test": 2}
    ordered = nifti(tmp_path, "data.classes=[b,a]")
    assert class_names(ordered) == ["b", "a"]
    assert load_splits(ordered)["train"][1].tolist() == [1, 0]  # a0 then b0, in the CSV's order
    medmnist = OmegaConf.to_object(compose_config("data=adrenalmnist3d")).data
    assert class_names(medmnist) == ["normal", "hyperplasia"]
    assert class_names(OmegaConf.to_object(compose_config("data=synthetic")).data) == ["0", "1"]


def test_a_changed_folder_is_another_config_so_a_finished_run_is_not_skipped_for_it(tmp_path):
    """The config says where the volumes are, not what they hold: ``data.content`` (a param, in the config hash)
    does."""
    six(tmp_path)
    cfg = nifti(tmp_path, "data.size=16")
    before = content_params(cfg)
    assert content_params(cfg) == before and set(before) == {"data.content"}
    save(tmp_path / "a0.nii.gz", noise(99))
    assert content_params(cfg) != before
    medmnist = OmegaConf.to_object(compose_config("data=adrenalmnist3d")).data
    assert content_params(medmnist) == {}  # checked against its MD5 instead
