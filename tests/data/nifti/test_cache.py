"""The cache of ``data=nifti`` (:mod:`src.data.nifti.cache`) on real NIfTI files: its key, where it lives, its name,
what its meta records, a corrupt cache built again, and every bad input (the CSV, the volumes, the cache's folder)
refused in one line by the dry run's check and the job's build alike."""

from __future__ import annotations

import json
import logging
import os
import re

import numpy as np
import pytest
from omegaconf import OmegaConf

from src.data.files import check_file, npz_path
from src.data.loaders import load_splits
from src.data.names import REBUILD
from src.data.nifti.cache import ensure, read_meta
from tests.data.helpers import refusal
from tests.data.nifti.folders import CASES, CSV, bad_cases, nifti, noise, prepare, save, six, write_csv
from tests.helpers import compose_config


def test_default_spacing_is_the_training_median_and_keys_are_recorded(tmp_path):
    zooms = {"t1": 1.0, "t2": 2.0, "t3": 4.0, "v": 9.0, "w": 9.0, "s": 9.0, "u": 9.0}  # along S; not val and test
    for name, z in zooms.items():
        save(tmp_path / f"{name}.nii.gz", noise(0, (8, 8, 8)), np.diag([0.5, 0.5, z, 1]))
    labels = [("t1", "a", "train"), ("t2", "b", "train"), ("t3", "a", "train"), ("v", "a", "val"), ("w", "b", "val")]
    labels += [("s", "b", "test"), ("u", "a", "test")]
    write_csv(tmp_path, [(f"{name}.nii.gz", label, split) for name, label, split in labels])
    meta = read_meta(ensure(nifti(tmp_path, "data.size=16")))
    assert meta["spacing"] == [0.5, 0.5, 2.0]
    assert meta["spacings"] == [[[0.5, 0.5, 9.0], 4], [[0.5, 0.5, 1.0], 1], [[0.5, 0.5, 2.0], 1], [[0.5, 0.5, 4.0], 1]]
    assert meta["images"] == {
        "train": ["t1.nii.gz", "t2.nii.gz", "t3.nii.gz"],
        "val": ["v.nii.gz", "w.nii.gz"],
        "test": ["s.nii.gz", "u.nii.gz"],
    }
    assert meta["preprocessing"] == {"size": 16, "in_channels": 1, "spacing": None, "intensity": "minmax"}


def test_the_cache_is_reused_and_rebuilt_when_a_file_the_csv_or_a_key_changes(tmp_path):
    six(tmp_path)
    cfg = nifti(tmp_path, "data.size=16")
    first = ensure(cfg)
    built = first.stat().st_mtime_ns
    assert ensure(cfg) == first and first.stat().st_mtime_ns == built and check_file(cfg)  # reused, not rebuilt
    keyed = {
        "size": ensure(nifti(tmp_path, "data.size=20")),
        "spacing": ensure(nifti(tmp_path, "data.size=16", "data.spacing=[2,2,2]")),
        "intensity": ensure(nifti(tmp_path, "data.size=16", "data.intensity=zscore")),
    }
    save(tmp_path / "a0.nii.gz", noise(99))
    keyed["file"] = ensure(cfg)
    swapped = {"a0.nii.gz,a,train": "a0.nii.gz,a,val", "a1.nii.gz,a,val": "a1.nii.gz,a,train"}
    (tmp_path / CSV).write_text(re.sub("|".join(swapped), lambda m: swapped[m[0]], (tmp_path / CSV).read_text()))
    keyed["csv"] = ensure(cfg)
    assert len({first, *keyed.values()}) == 1 + len(keyed), keyed
    assert first.exists()  # another key's cache stays (a sweep over data.size needs both)


def test_the_cache_lives_beside_the_data_without_medsweep_cache_dir(tmp_path, monkeypatch, cache_dir):
    six(tmp_path)
    cfg = nifti(tmp_path, "data.size=16")
    assert npz_path(cfg).parent == cache_dir / "volumes"
    monkeypatch.delenv("MEDSWEEP_CACHE_DIR")
    assert not check_file(cfg)  # nothing written by the check
    assert not (tmp_path / ".medsweep").exists()
    assert ensure(cfg).parent == tmp_path / ".medsweep" and check_file(cfg)


def test_a_folder_of_a_long_name_names_a_cache_that_fits_a_file_name(tmp_path, monkeypatch):
    monkeypatch.delenv("MEDSWEEP_CACHE_DIR")
    cfg = nifti(six(tmp_path / ("x" * 250)), "data.size=16")
    assert ensure(cfg).name.startswith(f"nifti_{'x' * 100}_16_")


def test_a_folder_named_in_a_wide_script_names_a_cache_that_fits_a_file_name(tmp_path, monkeypatch):
    """100 characters of 3 bytes each would make the name 330 bytes, past the 255 a file name may have."""
    monkeypatch.delenv("MEDSWEEP_CACHE_DIR")
    root = six(tmp_path / ("漢" * 80))
    cfg = OmegaConf.to_object(compose_config("data=nifti", f'data.root="{root}"', "data.size=16")).data  # quoted
    path = ensure(cfg)
    assert path.name.startswith(f"nifti_{'漢' * 33}_16_") and len(os.fsencode(path.name)) <= 255
    assert check_file(cfg)


@pytest.mark.parametrize("spoil", ["random-bytes", "empty", "half", "overwritten-inside"])
def test_a_corrupt_cache_is_built_again(tmp_path, spoil):
    cfg = nifti(six(tmp_path), "data.size=16")
    path = ensure(cfg)
    meta, whole = read_meta(path), path.read_bytes()
    spoilt = {
        "random-bytes": np.random.default_rng(0).bytes(len(whole)),
        "empty": b"",
        "half": whole[: len(whole) // 2],
        "overwritten-inside": whole[:600] + b"\xff" * 100 + whole[700:],  # in train_images: the meta reads
    }
    path.write_bytes(spoilt[spoil])
    assert not check_file(cfg) and path.read_bytes() == spoilt[spoil]  # a dry run: to be built, nothing written
    assert ensure(cfg) == path and read_meta(path) == meta
    assert load_splits(cfg)["train"][0].shape == (2, 1, 16, 16, 16)


def test_a_folder_in_place_of_the_cache_is_one_line(tmp_path):
    cfg = nifti(six(tmp_path), "data.size=16")
    path = npz_path(cfg)
    path.mkdir(parents=True)
    for check in (check_file, ensure, load_splits):
        assert (
            refusal(check, cfg) == f"the cache {path} is a folder: remove it (data=nifti builds the cache in its place)"
        )


def test_a_cache_that_reads_but_holds_no_arrays_is_named_with_its_fix(tmp_path):
    cfg = nifti(six(tmp_path), "data.size=16")
    path = ensure(cfg)
    np.savez(path, meta=np.array(json.dumps(read_meta(path))))
    assert refusal(load_splits, cfg).endswith(f": {REBUILD}")


def test_a_cache_folder_that_is_a_file_is_one_line(tmp_path, monkeypatch, caplog):
    """... before any volume is read (it was found once every volume was preprocessed)."""
    caplog.set_level(logging.INFO, logger="src.data.nifti")
    six(tmp_path)
    monkeypatch.delenv("MEDSWEEP_CACHE_DIR")
    (tmp_path / ".medsweep").write_text("not a folder")
    cfg = nifti(tmp_path, "data.size=16")
    assert not check_file(cfg)  # a dry run writes nothing
    assert re.fullmatch(
        rf"cannot write the cache {re.escape(str(tmp_path))}/\.medsweep/nifti_\S+\.npz \(File exists\): make "
        rf"{re.escape(str(tmp_path))}/\.medsweep a writable folder, or set MEDSWEEP_CACHE_DIR=<a writable folder> to "
        rf"keep it there",
        refusal(ensure, cfg),
    )
    assert "preprocessing" not in caplog.text


def test_a_cache_folder_of_a_name_too_long_is_one_line(tmp_path, monkeypatch):
    six(tmp_path)
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path / ("x" * 300)))
    cfg = nifti(tmp_path, "data.size=16")
    for check in (check_file, ensure):
        assert re.fullmatch(
            rf"cannot read the cache {re.escape(str(tmp_path))}/x{{300}}/volumes/nifti_\S+\.npz \(File name too "
            rf"long\): make \S+ a folder that can be read and written, or set MEDSWEEP_CACHE_DIR=<a writable folder> "
            rf"to keep it there",
            refusal(check, cfg),
        )


@pytest.mark.parametrize("case", CASES)
def test_each_bad_input_is_one_line_naming_the_file_or_row_and_the_fix(tmp_path, case):
    prepare(tmp_path, case)
    overrides, start = bad_cases(tmp_path)[case]
    cfg = nifti(tmp_path, "data.size=16", *overrides)
    for check in (check_file, ensure):  # the dry run's check and the job's build refuse it alike
        assert refusal(check, cfg).startswith(start), (check.__name__, refusal(check, cfg))
