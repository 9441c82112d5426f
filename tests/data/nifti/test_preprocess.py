"""The volumes to cubes (:mod:`src.data.nifti.preprocess`), on real NIfTI files: orientation, spacing, intensity,
channels, the headers read as MONAI resamples them, MONAI imported without torchvision, voxels that are no numbers and
a file cut short refused."""

from __future__ import annotations

import sys

import nibabel as nib
import numpy as np
import pytest
import torch

from src.data.files import check_file, npz_path
from src.data.loaders import load_splits
from src.data.nifti.cache import ensure, read_meta
from tests.data.helpers import refusal
from tests.data.nifti.folders import CSV, folder, nifti, noise, save, six, with_sform, write_csv
from tests.helpers import run_process


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
    for name in ("a1", "a2", "b0", "b1", "b2"):
        save(tmp_path / f"{name}.nii.gz", noise(0, (33, 33, 33)))
    rows = [(f"{name}.nii.gz", "a", "train") for name in variants] + [
        ("a1.nii.gz", "a", "val"),
        ("a2.nii.gz", "a", "test"),
    ]
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
        "import sys; from src.data.nifti.preprocess import monai_transforms; monai_transforms(); "
        "print(sorted(m for m in sys.modules if m.startswith('torchvision')))"
    )
    result = run_process([sys.executable, "-c", code], timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]


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


def test_a_volume_cut_short_is_named_by_its_streams_error_not_monais(tmp_path):
    six(tmp_path)
    whole = (tmp_path / "b1.nii.gz").read_bytes()
    (tmp_path / "b1.nii.gz").write_bytes(whole[: len(whole) // 2])  # its header reads: the voxels do not
    cfg = nifti(tmp_path, "data.size=16")
    assert not check_file(cfg)
    assert refusal(ensure, cfg) == (
        f"{tmp_path / CSV} line 5: {tmp_path / 'b1.nii.gz'} is damaged (gzip: Compressed file ended before the "
        f"end-of-stream marker was reached): replace it with an intact copy, or drop the row"
    )
