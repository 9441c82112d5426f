"""data=nifti on real NIfTI files written by nibabel in temp dirs: preprocessing (orientation, spacing, intensity,
channels), the cache and its key, the labels CSV and its split, every bad input as one line (some through the real
CLI), the inspect command, other cube sizes in the models and the memory predictor, and a real run's MLflow record."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
from pathlib import Path

import mlflow
import nibabel as nib
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from src.config import ModelConfig, Stem
from src.data import REBUILD, check_file, class_names, content_params, load_splits, npz_path, split_sizes
from src.errors import UsageError
from src.models import MODELS, build_model
from src.perf.memory import predict
from src.volumes import ensure, read_meta
from tests.helpers import compose_config, run_cli, run_process, runs

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


def refusal(load, *args) -> str:
    with pytest.raises(UsageError) as err:
        load(*args)
    assert "\n" not in str(err.value)
    return str(err.value)


# ---------------------------------------------------------------- preprocessing


def blob(n: int = 33) -> np.ndarray:
    """A smooth off-centre Gaussian (interpolation barely changes it), asymmetric on every axis (flips show)."""
    grid = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), axis=-1)
    return np.exp(-((grid - np.array([12, 16, 19])) ** 2).sum(-1) / (2 * 5.0**2))


def reoriented(image: nib.Nifti1Image, codes: str) -> nib.Nifti1Image:
    """The same voxels in world space, stored along the axes ``codes`` (``"PSL"``): nibabel's reorientation."""
    start, target = nib.orientations.io_orientation(image.affine), nib.orientations.axcodes2ornt(tuple(codes))
    return image.as_reoriented(nib.orientations.ornt_transform(start, target))


def test_volumes_in_other_orientations_and_spacings_come_out_as_their_ras_isotropic_original(tmp_path):
    affine = np.eye(4)
    affine[:3, 3] = [-10, 5, 3]
    original = nib.Nifti1Image(blob().astype(np.float32), affine)
    thick = nib.Nifti1Image(blob()[:, :, ::2].astype(np.float32), affine @ np.diag([1, 1, 2, 1]))  # 2 mm slices
    variants = {
        "ras": original,
        "psl": reoriented(original, "PSL"),
        "lpi": reoriented(original, "LPI"),
        "thick": thick,
        "thick_ail": reoriented(thick, "AIL"),
    }
    for name, image in variants.items():
        nib.save(image, tmp_path / f"{name}.nii.gz")
    assert nib.aff2axcodes(nib.load(tmp_path / "psl.nii.gz").affine) == ("P", "S", "L")
    for name in ("b0", "b1", "b2"):
        save(tmp_path / f"{name}.nii.gz", noise(0, (33, 33, 33)))
    rows = [(f"{name}.nii.gz", "a", "train") for name in variants]
    write_csv(tmp_path, rows + [("b0.nii.gz", "b", "train"), ("b1.nii.gz", "b", "val"), ("b2.nii.gz", "b", "test")])
    cfg = nifti(tmp_path, "data.spacing=[1,1,1]", "data.size=28")
    images = load_splits(cfg)["train"][0][:, 0].numpy().astype(int)
    ras = images[0]
    assert ras.max() == 255 and ras.min() < 5  # min-max per volume, the blob's peak inside the 28^3 centre
    for i, name in enumerate(variants):
        difference = np.abs(images[i] - ras)
        if name in ("psl", "lpi"):
            assert difference.max() == 0, name  # a reorientation moves voxels, interpolates none
        else:
            assert difference.max() <= 8 and difference.mean() < 1, (name, difference.max(), difference.mean())


def test_the_headers_are_read_with_the_affine_monai_resamples_with(tmp_path):
    """An sform that disagrees with the header's pixdim (nibabel's set_sform leaves pixdim): MONAI's reader takes the
    qform, so the spacings seen, the median and the size guard must too, or the volume is resampled at another scale
    than they assume."""
    six(tmp_path)
    with_sform(tmp_path / "a0.nii.gz", np.diag([2.0, 2.0, 2.0, 1.0]))  # its pixdim stays 1 mm
    meta = read_meta(ensure(nifti(tmp_path, "data.size=16")))
    assert meta["spacings"] == [[[1.0, 1.0, 1.0], 6]] and meta["spacing"] == [1.0, 1.0, 1.0]


def test_default_spacing_is_the_training_median_and_keys_are_recorded(tmp_path):
    zooms = {"t1": 1.0, "t2": 2.0, "t3": 4.0, "v": 9.0, "s": 9.0}  # along S; val and test do not count
    for name, z in zooms.items():
        save(tmp_path / f"{name}.nii.gz", noise(0, (8, 8, 8)), np.diag([0.5, 0.5, z, 1]))
    labels = [("t1", "a", "train"), ("t2", "b", "train"), ("t3", "a", "train"), ("v", "a", "val"), ("s", "b", "test")]
    write_csv(tmp_path, [(f"{name}.nii.gz", label, split) for name, label, split in labels])
    meta = read_meta(ensure(nifti(tmp_path, "data.size=16")))
    assert meta["spacing"] == [0.5, 0.5, 2.0]
    assert meta["spacings"] == [[[0.5, 0.5, 9.0], 2], [[0.5, 0.5, 1.0], 1], [[0.5, 0.5, 2.0], 1], [[0.5, 0.5, 4.0], 1]]
    assert meta["images"] == {
        "train": ["t1.nii.gz", "t2.nii.gz", "t3.nii.gz"],
        "val": ["v.nii.gz"],
        "test": ["s.nii.gz"],
    }
    assert meta["preprocessing"] == {"size": 16, "in_channels": 1, "spacing": None, "intensity": "minmax"}


def ramp() -> np.ndarray:
    """-1000 .. 1000 (HU-like) along x, 16^3."""
    return np.broadcast_to(np.linspace(-1000, 1000, 16)[:, None, None], (16, 16, 16)).copy()


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ((), lambda v: (v - v.min()) / (v.max() - v.min())),
        (("data.intensity=window",), lambda v: np.clip((v - (40 - 200)) / 400, 0, 1)),
        (
            ("data.intensity=window", "data.window_level=-600", "data.window_width=1500"),
            lambda v: np.clip((v + 600 + 750) / 1500, 0, 1),
        ),
        (("data.intensity=zscore",), lambda v: np.clip(((v - v.mean()) / v.std() + 3) / 6, 0, 1)),
    ],
    ids=["minmax", "window", "lung-window", "zscore"],
)
def test_intensity_normalisation_by_its_key(tmp_path, overrides, expected):
    """No resampling, crop or pad here (the volumes' own spacing and size): what is left is the intensity map."""
    six(tmp_path)
    save(tmp_path / "a0.nii.gz", ramp())
    cfg = nifti(tmp_path, "data.size=16", "data.spacing=[1,1,1]", *overrides)
    got = load_splits(cfg)["train"][0][0, 0].numpy().astype(float)
    assert np.abs(got - np.round(expected(ramp()) * 255)).max() <= 1


def test_four_d_volumes_are_channels_when_data_in_channels_says_so(tmp_path):
    rows = [(f"{c}{i}.nii.gz", c, s) for i, s in enumerate(("train", "val", "test")) for c in "ab"]
    folder(tmp_path, rows, shape=(12, 12, 12, 2))
    train = load_splits(nifti(tmp_path, "data.in_channels=2", "data.size=16"))["train"][0]
    assert train.shape == (2, 2, 16, 16, 16) and train.dtype == torch.uint8
    assert (train[:, 0] != train[:, 1]).any()  # each channel normalised on its own


def test_monai_is_imported_without_torchvision():
    """A torchvision built for another torch fails half-way through its import (and medsweep never needs it)."""
    code = (
        "import sys; from src.volumes.preprocess import monai_transforms; monai_transforms(); "
        "print(sorted(m for m in sys.modules if m.startswith('torchvision')))"
    )
    result = run_process([sys.executable, "-c", code], timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]


# ---------------------------------------------------------------- the cache


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
    (tmp_path / CSV).write_text((tmp_path / CSV).read_text().replace("a1.nii.gz,a,val", "a1.nii.gz,b,val"))
    keyed["csv"] = ensure(cfg)
    assert len({first, *keyed.values()}) == 1 + len(keyed), keyed
    assert first.exists()  # another key's cache stays (a sweep over data.size needs both)


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
    caplog.set_level(logging.INFO, logger="src.volumes")
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


# ---------------------------------------------------------------- the CSV: classes and splits


def test_classes_from_the_csv_reach_class_names_and_split_sizes(tmp_path):
    cfg = nifti(six(tmp_path))
    assert class_names(cfg) == ["a", "b"] and split_sizes(cfg) == {"train": 2, "val": 2, "test": 2}
    ordered = nifti(tmp_path, "data.classes=[b,a]")
    assert class_names(ordered) == ["b", "a"]
    assert load_splits(ordered)["train"][1].tolist() == [1, 0]  # a0 then b0, in the CSV's order
    medmnist = OmegaConf.to_object(compose_config("data=adrenalmnist3d")).data
    assert class_names(medmnist) == ["normal", "hyperplasia"]
    assert class_names(OmegaConf.to_object(compose_config("data=synthetic")).data) == ["0", "1"]


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


# ---------------------------------------------------------------- bad input: one line each


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
        "repeated-column": (
            (),
            f"{csv} has columns ['image', 'label', 'label', '', ''], label more than once: keep one column of each "
            "name",
        ),
    }


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
        write_csv(
            root,
            [[image, label, "val" if label == "b" and split == "train" else split] for image, label, split in rows],
        )
    elif case == "bad-split":
        write_csv(root, [*rows[:3], [rows[3][0], "b", "validation"], *rows[4:]])
    elif case == "empty-split":
        write_csv(root, [[image, label, "val" if split == "test" else split] for image, label, split in rows])
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
    elif case == "repeated-column":  # csv.DictReader would keep the last: the splits as labels
        write_csv(root, [[*row, "", ""] for row in rows], header="image,label,label,,")  # unnamed ones are no repeat


CASES = list(bad_cases(Path("/")))


@pytest.mark.parametrize("voxels", ["all-nan", "one-inf"])
def test_a_volume_with_nan_or_infinite_voxels_is_refused_and_no_cache_written(tmp_path, voxels):
    six(tmp_path)
    volume = np.full((12, 12, 12), np.nan) if voxels == "all-nan" else noise(0)
    volume[3, 4, 5] = np.inf if voxels == "one-inf" else np.nan
    save(tmp_path / "b1.nii.gz", volume)
    cfg = nifti(tmp_path, "data.size=16")
    assert not check_file(cfg)  # its header reads: the voxels are read when the cache is built
    count = "1728 NaN or infinite voxels" if voxels == "all-nan" else "1 NaN or infinite voxel"
    assert refusal(ensure, cfg) == (
        f"{tmp_path / CSV} line 5: {tmp_path / 'b1.nii.gz'} has {count}: make each a number (e.g. the background "
        f"value), or drop the row"
    )
    assert list(npz_path(cfg).parent.glob(f"*{npz_path(cfg).stem}*")) == []  # no cache, no partial file


def test_a_volume_cut_short_is_named_by_nibabels_error_not_monais(tmp_path):
    six(tmp_path)
    whole = (tmp_path / "b1.nii.gz").read_bytes()
    (tmp_path / "b1.nii.gz").write_bytes(whole[: len(whole) // 2])  # its header reads: the voxels do not
    cfg = nifti(tmp_path, "data.size=16")
    assert not check_file(cfg)
    assert refusal(ensure, cfg) == (
        f"{tmp_path / CSV} line 5: {tmp_path / 'b1.nii.gz'} is not a volume nibabel reads (Compressed file ended "
        f"before the end-of-stream marker was reached): replace it, or drop the row"
    )


@pytest.mark.parametrize("case", CASES)
def test_each_bad_input_is_one_line_naming_the_file_or_row_and_the_fix(tmp_path, case):
    prepare(tmp_path, case)
    overrides, start = bad_cases(tmp_path)[case]
    cfg = nifti(tmp_path, "data.size=16", *overrides)
    for check in (check_file, ensure):  # the dry run's check and the job's build refuse it alike
        assert refusal(check, cfg).startswith(start), (check.__name__, refusal(check, cfg))


@pytest.mark.parametrize(
    "case",
    ["missing-file", pytest.param("columns", marks=pytest.mark.slow), pytest.param("four-d", marks=pytest.mark.slow)],
)
def test_the_training_command_refuses_bad_input_in_one_line_before_any_run(tmp_path, store, case):
    data = tmp_path / "scans"
    prepare(data, case)
    overrides, start = bad_cases(data)[case]
    result = run_cli(
        "data=nifti",
        f"data.root={data}",
        *overrides,
        "device=cpu",
        f"mlflow.tracking_uri={store}",
        f"hydra.run.dir={tmp_path}/run",
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]] and lines[-1].startswith(
        f"error: {start}"
    )
    assert runs(store) == []


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero-affine", "huge-index", "long-root"])
def test_the_inspect_command_refuses_bad_input_in_one_line(tmp_path, case):
    prepare(tmp_path, case)
    overrides, start = bad_cases(tmp_path)[case]
    result = run_cli(
        "data=nifti", f"data.root={tmp_path}", "data.size=16", *overrides, module="src.volumes", timeout=300
    )
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {start}")


def test_nifti_keys_are_range_checked_and_medmnist_sizes_stay_28_and_64():
    for overrides, line in [
        (("data=nifti", "data.size=15"), "data.size=15 must be in [16, 256] for data=nifti"),
        (("data=nifti", "data.size=257"), "data.size=257 must be in [16, 256] for data=nifti"),
        (("data=adrenalmnist3d", "data.size=100"), "data.size=100 is not a MedMNIST 3D size: use data.size=28 or 64"),
        (("data=nifti", "data.spacing=[1,0,1]"), "data.spacing[1]=0.0 must be in (0, 100.0]"),
        (("data=nifti", "data.spacing=[1e300,1e300,1e300]"), "data.spacing[0]=1e+300 must be in (0, 100.0]"),
        (("data=nifti", "data.split_fractions=[0.8,0.1,0.2]"), "data.split_fractions=[0.8, 0.1, 0.2] must sum to 1"),
        (("data=nifti", "data.split_fractions=[1,0,0]"), "data.split_fractions[0]=1.0 must be in (0, 1)"),
        (("data=nifti", "data.window_width=0"), "data.window_width=0.0 must be > 0 (the window's width)"),
        (("data=nifti", "data.classes=[a,a]"), "data.classes=['a', 'a'] must name 2 or more classes, each once"),
    ]:
        with pytest.raises(ValueError, match=f"^{re.escape(line)}"):
            OmegaConf.to_object(compose_config(*overrides))
    for size in (16, 37, 256):
        assert nifti(Path("/x"), f"data.size={size}").size == size


# ---------------------------------------------------------------- sizes other than 28 and 64


@pytest.mark.parametrize(
    "names,size,stem",
    [
        (list(MODELS), 16, Stem.standard),  # the smallest cube through the standard stem (4x) and every stage
        (["resnet10", "densenet121"], 37, Stem.small),  # an odd side
        (["resnet10", "densenet121"], 256, Stem.standard),  # the largest
    ],
    ids=["all-16", "odd-37", "largest-256"],
)
def test_models_map_other_cube_sizes_to_their_classes(names, size, stem):
    """Shapes on the meta device (a family's depth does not change its downsampling)."""
    data = nifti(Path("/x"), f"data.size={size}")
    for name in names:
        with torch.device("meta"):
            out = build_model(ModelConfig(name=name, stem=stem), data)(torch.empty(2, 1, size, size, size))
        assert out.shape == (2, 2), name


def test_the_memory_predictor_takes_other_cube_sizes(tmp_path):
    six(tmp_path)
    for size in (16, 40):
        cfg = OmegaConf.to_object(
            compose_config("data=nifti", f"data.root={tmp_path}", f"data.size={size}", "model=resnet10", "batch_size=2")
        )
        prediction = predict(cfg, torch.device("cpu"))
        assert prediction.data_mb == 6 * (size**3 + 8) / 2**20 and prediction.activations_mb > 0


# ---------------------------------------------------------------- commands


@pytest.mark.slow
def test_the_inspect_command_builds_and_describes_the_cache(tmp_path):
    six(tmp_path)
    result = run_cli("data=nifti", f"data.root={tmp_path}", "data.size=16", module="src.volumes", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    cfg = nifti(tmp_path, "data.size=16")
    path = npz_path(cfg)
    lines = result.stdout.strip().splitlines()
    assert lines[:4] == [
        f"volumes   {tmp_path} (labels {tmp_path / CSV})",
        "classes   0 a: train 1, val 1, test 1 | 1 b: train 1, val 1, test 1",
        "splits    train 2, val 2, test 2 (the CSV's split column)",
        "spacings  seen, mm along R x A x S: 1 x 1 x 1 (6 volumes)",
    ]
    assert (
        lines[4]
        == "          resampled to 1 x 1 x 1 mm (the training median), cropped or padded to 16^3, intensity minmax"
    )
    assert lines[5].startswith(f"cache     {path} (") and read_meta(path)["digest"] in lines[5]
    path.write_bytes(b"")  # a corrupt cache: built again, then described
    again = run_cli("data=nifti", f"data.root={tmp_path}", "data.size=16", module="src.volumes", timeout=300)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[:5] == lines[:5], again.stderr[-3000:]
    not_nifti = run_cli("data=synthetic", module="src.volumes", timeout=300)
    assert not_nifti.returncode == 2
    assert not_nifti.stderr.strip().splitlines() == [
        "error: python -m src.volumes describes a NIfTI folder, not data=synthetic: add data=nifti"
    ]


@pytest.mark.slow
def test_a_run_trains_on_a_nifti_folder_and_records_its_dataset_and_keys(tmp_path, store):
    """A short real run through ``python -m src.train``: the dataset inputs (digest of the CSV and the volumes, the
    folder's name, its classes and spacing) and the preprocessing keys as params."""
    data = folder(tmp_path / "scans", [(f"v{i}.nii.gz", "ab"[i % 2]) for i in range(20)], header="image,label")
    result = run_cli(
        "data=nifti",
        f"data.root={data}",
        "data.size=16",
        "data.intensity=zscore",
        "model=resnet10",
        "batch_size=4",
        "epochs=1",
        "limit_batches=2",
        "num_threads=1",
        "device=cpu",
        "mlflow.system_metrics=false",
        f"mlflow.tracking_uri={store}",
        f"hydra.run.dir={tmp_path}/run",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    digest = hashlib.md5((data / CSV).read_bytes())
    for line in (data / CSV).read_text().split()[1:]:
        digest.update(hashlib.md5((data / line.split(",")[0]).read_bytes()).hexdigest().encode())
    inputs = {entry.dataset.name: entry.dataset for entry in run.inputs.dataset_inputs}
    assert sorted(inputs) == ["scans_16/test", "scans_16/train", "scans_16/val"]
    for split, dataset in inputs.items():
        profile = json.loads(dataset.profile)
        assert dataset.digest == digest.hexdigest(), split
        assert json.loads(dataset.source) == {"uri": (data / CSV).as_uri()}
        assert (profile["classes"], profile["spacing_mm"], profile["size"]) == (["a", "b"], [1.0, 1.0, 1.0], 16)
    assert json.loads(inputs["scans_16/train"].profile)["class_counts"] == [7, 7]
    params = run.data.params
    assert {key: params[key] for key in ("data.name", "data.size", "data.intensity", "data.spacing")} == {
        "data.name": "nifti",
        "data.size": "16",
        "data.intensity": "zscore",
        "data.spacing": "None",
    }
    assert params["data.labels"] == str(data / CSV)
    assert mlflow.MlflowClient(store).get_run(run.info.run_id).info.status == "FINISHED"
    assert os.path.exists(tmp_path / "run" / "eval" / "test_predictions.csv")


@pytest.mark.slow
def test_a_dry_run_and_the_memory_command_take_a_nifti_folder_and_write_no_cache(tmp_path, store, monkeypatch):
    data = six(tmp_path / "scans")
    monkeypatch.delenv("MEDSWEEP_CACHE_DIR")  # the cache would go beside the data: the dry run writes none
    common = ("data=nifti", f"data.root={data}", "data.size=16", "model=resnet10", "batch_size=2", "device=cpu")
    dry = run_cli(*common, "dry_run=true", f"mlflow.tracking_uri={store}", f"hydra.run.dir={tmp_path}/run", timeout=600)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert dry.stdout.strip().splitlines()[-1].startswith("total: 1 to run")
    memory = run_cli(*common, module="src.memory", timeout=600)
    assert memory.returncode == 0, memory.stderr[-3000:]
    assert "predicted peak memory on cpu, batch 2" in memory.stdout
    assert not (data / ".medsweep").exists() and runs(store) == []
