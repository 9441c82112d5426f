"""MedMNIST loading on the real files, checksums, the download path (local HTTP server), synthetic data, loaders."""

from __future__ import annotations

import dataclasses
import functools
import http.server
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from medmnist import INFO

import src.data
from src.config import DataConfig, Loader
from src.data import ARRAYS_CHECKED, check_file, load_splits, make_loader, npz_path
from src.errors import UsageError

REDOWNLOAD = "delete it and rerun with data.download=true"
REGENERATE = "delete it (data=synthetic regenerates it from a fixed seed)"


def adrenal(root: Path, **kw) -> DataConfig:
    return DataConfig(name="adrenalmnist3d", root=str(root), num_classes=2, task="binary-class", **kw)


@pytest.mark.parametrize("size", [28, 64])
def test_real_files_load_with_their_shapes(shared_data, size):
    splits = load_splits(adrenal(shared_data, size=size, download=False))
    assert {k: len(v[1]) for k, v in splits.items()} == {"train": 1188, "val": 98, "test": 298}
    images, labels = splits["train"]
    assert images.shape == (1188, 1, size, size, size) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64 and set(labels.tolist()) == {0, 1}


def test_missing_file_without_download_names_the_fix(tmp_path):
    with pytest.raises(
        UsageError, match=r"adrenalmnist3d\.npz not found and data\.download=false: set data\.download=true"
    ):
        load_splits(adrenal(tmp_path, download=False))


def refusal(load, *args) -> str:
    """The one-line message of the :class:`UsageError` ``load(*args)`` raises."""
    with pytest.raises(UsageError) as err:
        load(*args)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_wrong_checksum_is_refused(tmp_path, shared_data):
    bad = tmp_path / "adrenalmnist3d.npz"
    shutil.copy(shared_data / "vesselmnist3d.npz", bad)
    assert refusal(load_splits, adrenal(tmp_path, download=False)) == (
        f"{bad} has MD5 b41fd4f7e7e2feedddb201585ecafa1b, expected bbd3c5a5576322bc4cdfea780653b1ce: "
        f"it is vesselmnist3d at data.size=28: rename it vesselmnist3d.npz and set data=vesselmnist3d, or {REDOWNLOAD}"
    )


def test_corrupt_file_is_told_to_download_again(tmp_path):
    bad = tmp_path / "adrenalmnist3d.npz"
    bad.write_bytes(b"not a zip")
    assert refusal(load_splits, adrenal(tmp_path)) == (
        f"{bad} has MD5 {src.data.file_md5(bad)}, expected {INFO['adrenalmnist3d']['MD5']}: "
        f"no official MedMNIST file (corrupt or partial): {REDOWNLOAD}"
    )


def test_64_file_under_the_28_name_is_named_and_the_fix_loads_it(tmp_path, shared_data):
    bad = tmp_path / "adrenalmnist3d.npz"
    shutil.copy(shared_data / "adrenalmnist3d_64.npz", bad)
    assert refusal(load_splits, adrenal(tmp_path, download=False)) == (
        f"{bad} has MD5 {INFO['adrenalmnist3d']['MD5_64']}, expected {INFO['adrenalmnist3d']['MD5']}: it is "
        f"adrenalmnist3d at data.size=64: rename it adrenalmnist3d_64.npz and set data.size=64, or {REDOWNLOAD}"
    )
    bad.rename(tmp_path / "adrenalmnist3d_64.npz")
    assert load_splits(adrenal(tmp_path, size=64, download=False))["train"][0].shape[-1] == 64


def test_md5_is_hashed_once_per_version_of_the_file(tmp_path, shared_data, monkeypatch):
    shutil.copy(shared_data / "adrenalmnist3d.npz", tmp_path)
    hashed, hash_file = [], src.data.file_md5
    monkeypatch.setattr(src.data, "file_md5", lambda path: hashed.append(path) or hash_file(path))
    cfg = adrenal(tmp_path, download=False)
    assert [check_file(cfg) for _ in range(3)] == [True] * 3 and len(hashed) == 1
    stat = npz_path(cfg).stat()
    os.utime(npz_path(cfg), ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert check_file(cfg) and len(hashed) == 2


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


def test_unknown_dataset_lists_the_valid_ones(tmp_path):
    with pytest.raises(UsageError, match="data.name=pathmnist is not a MedMNIST 3D dataset: use one of .*organmnist3d"):
        load_splits(DataConfig(name="pathmnist", root=str(tmp_path), num_classes=9))


@pytest.fixture
def http_root(tmp_path):
    """A real HTTP server on 127.0.0.1 serving ``tmp_path/served``."""
    served = tmp_path / "served"
    served.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield served, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_download_fetches_and_verifies(tmp_path, shared_data, http_root):
    served, base = http_root
    shutil.copy(shared_data / "adrenalmnist3d.npz", served / "adrenalmnist3d.npz")
    cfg = adrenal(tmp_path / "cache", url=f"{base}/adrenalmnist3d.npz")
    splits = load_splits(cfg)
    assert npz_path(cfg).exists() and len(splits["val"][1]) == 98


def test_download_of_a_bad_file_leaves_nothing_behind(tmp_path, http_root):
    served, base = http_root
    np.savez(served / "made.npz", train_images=np.zeros((2, 28, 28, 28), np.uint8))
    cfg = adrenal(tmp_path / "cache", url=f"{base}/made.npz")
    with pytest.raises(UsageError, match="downloaded .*made.npz has MD5 .*expected bbd3c5a5"):
        load_splits(cfg)
    assert list((tmp_path / "cache").iterdir()) == []


def test_download_failure_is_one_clear_line_offering_the_shipped_sets(tmp_path, http_root):
    _, base = http_root
    with pytest.raises(UsageError, match=r"download of .*missing.npz failed .*: check the network") as failed:
        load_splits(adrenal(tmp_path, url=f"{base}/missing.npz"))
    assert str(failed.value).endswith(
        "ships in data/medmnist (data=adrenalmnist3d, data=vesselmnist3d) or on data=synthetic"
    )


@pytest.mark.parametrize("size", [28, 64])
def test_synthetic_is_written_in_medmnist_format_and_balanced(tmp_path, size):
    cfg = DataConfig(name="synthetic", root=str(tmp_path), size=size, num_classes=2, synthetic_samples=[40, 10, 10])
    splits = load_splits(cfg)
    with np.load(npz_path(cfg), allow_pickle=False) as npz:
        assert sorted(npz.files) == sorted(f"{s}_{k}" for s in ("train", "val", "test") for k in ("images", "labels"))
    images, labels = splits["train"]
    assert images.shape == (40, 1, size, size, size) and 10 < int(labels.sum()) < 30
    ball, cube = images[labels == 0].float(), images[labels == 1].float()
    assert ball.mean() < cube.mean()  # the cube of the same radius has more bright voxels: learnable
    assert torch.equal(load_splits(cfg)["train"][0], images)  # same data on every load


def test_synthetic_volumes_past_the_free_memory_are_refused_before_any_is_made(tmp_path):
    samples = 2 * psutil.virtual_memory().available // 28**3  # twice what fits
    cfg = DataConfig(name="synthetic", root=str(tmp_path), num_classes=2, synthetic_samples=[samples, 1, 1])
    message = refusal(check_file, cfg)
    assert message.startswith(f"data.synthetic_samples=[{samples}, 1, 1] at data.size=28 make ") and message.endswith(
        "GiB of memory free: lower data.synthetic_samples"
    )
    assert refusal(load_splits, cfg) == message and list(tmp_path.iterdir()) == []


def synthetic(root: Path, **kw) -> DataConfig:
    return DataConfig(name="synthetic", root=str(root), num_classes=2, synthetic_samples=[8, 4, 4], **kw)


def rewritten(cfg: DataConfig, **arrays: np.ndarray) -> Path:
    """``cfg``'s synthetic file, generated, with ``arrays`` put in its place."""
    load_splits(cfg)
    path = npz_path(cfg)
    with np.load(path) as npz:
        kept = dict(npz)
    np.savez(path, **{**kept, **arrays})
    return path


NAN_IMAGES = np.full((8, 28, 28, 28), np.nan, np.float32)
BAD_ARRAYS = {
    "nan images": (
        {"train_images": NAN_IMAGES},
        "train split: images of dtype float32, expected uint8 (MedMNIST's format)",
    ),
    "labels too large": (
        {"train_labels": np.arange(8).reshape(8, 1) % 3},
        "train split: labels in [0, 2], expected [0, 2) for data.num_classes=2",
    ),
    "negative label": (
        {"val_labels": np.array([0, -1, 1, 0])},
        "val split: labels in [-1, 1], expected [0, 2) for data.num_classes=2",
    ),
    "float labels": ({"test_labels": np.zeros((4, 1))}, "test split: labels of dtype float64, expected integers"),
    "fewer labels": (
        {"test_labels": np.zeros((3, 1), np.uint8)},
        "test split: 4 images but labels of shape (3, 1), expected one label per image",
    ),
    "two labels an image": (
        {"train_labels": np.zeros((8, 2), np.uint8)},
        "train split: 8 images but labels of shape (8, 2), expected one label per image",
    ),
    "empty split": (
        {"val_images": np.zeros((0, 28, 28, 28), np.uint8), "val_labels": np.zeros((0, 1), np.uint8)},
        "val split: no samples, expected at least one",
    ),
}


@pytest.mark.parametrize("arrays, what", BAD_ARRAYS.values(), ids=BAD_ARRAYS)
def test_bad_arrays_are_refused_on_load_with_the_fix(tmp_path, arrays, what):
    cfg = synthetic(tmp_path)
    path = rewritten(cfg, **arrays)
    assert refusal(load_splits, cfg) == f"{path}, {what}: {REGENERATE}"
    path.unlink()  # the fix: regenerated, it loads
    assert len(load_splits(cfg)["val"][1]) == 4


def test_corrupt_synthetic_file_is_told_to_delete_it(tmp_path):
    cfg = synthetic(tmp_path)
    npz_path(cfg).write_bytes(b"not a zip")
    message = refusal(load_splits, cfg)
    assert message.startswith(f"{npz_path(cfg)} is not a MedMNIST .npz (") and message.endswith(f"): {REGENERATE}")


def flipped_stream(path: Path) -> None:
    """64 bytes of the file's first compressed member overwritten: its zip headers stay, its deflate stream breaks."""
    data = bytearray(path.read_bytes())
    data[100:164] = b"\xff" * 64
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [flipped_stream, lambda path: path.write_bytes(b"")], ids=["stream", "empty"])
def test_a_damaged_or_empty_file_is_told_to_delete_it(tmp_path, damage):
    """A broken deflate stream raised zlib.error, an empty file EOFError: tracebacks."""
    cfg = synthetic(tmp_path)
    load_splits(cfg)
    damage(npz_path(cfg))
    ARRAYS_CHECKED.clear()  # what this process checked of the file before it changed in the same second
    message = refusal(load_splits, cfg)
    assert message.startswith(f"{npz_path(cfg)} is not a MedMNIST .npz (") and message.endswith(f"): {REGENERATE}")


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


def test_medmnist_keys_that_do_not_fit_the_dataset_name_its_values(shared_data):
    for key, value, held in (("num_classes", 3, 2), ("in_channels", 3, 1), ("task", "multi-class", "binary-class")):
        multi = {"task": "multi-class"} if key == "num_classes" else {}  # binary-class takes 2 classes only
        cfg = dataclasses.replace(adrenal(shared_data, download=False), **{key: value}, **multi)
        assert refusal(load_splits, cfg) == (
            f"data.{key}={value} does not fit adrenalmnist3d: its files hold {held}: set data.{key}={held}"
        )


def batches(loader, epoch):
    loader.sampler.set_epoch(epoch)
    return [(x.clone(), y.clone()) for x, y in loader]


def test_loaders_are_seeded_epoch_varying_and_agree(shared_data):
    cfg = adrenal(shared_data, download=False)
    train = load_splits(cfg)["train"]
    tensor = make_loader(cfg, train, 64, seed=3, train=True, device=torch.device("cpu"))
    standard = make_loader(
        DataConfig(**{**cfg.__dict__, "loader": Loader.dataloader}),
        train,
        64,
        seed=3,
        train=True,
        device=torch.device("cpu"),
    )
    first, again, other_epoch = batches(tensor, 0), batches(tensor, 0), batches(tensor, 1)
    assert len(first) == 1188 // 64  # drop_last in training
    assert all(torch.equal(a[1], b[1]) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0][1], other_epoch[0][1])
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, batches(standard, 0), strict=True)
    )
    reseeded = make_loader(cfg, train, 64, seed=4, train=True, device=torch.device("cpu"))
    assert not torch.equal(first[0][1], batches(reseeded, 0)[0][1])


def test_evaluation_loaders_keep_order_and_every_sample(shared_data):
    cfg = adrenal(shared_data, download=False)
    val = load_splits(cfg)["val"]
    loader = make_loader(cfg, val, 32, seed=0, train=False, device=torch.device("cpu"))
    assert torch.equal(torch.cat([y for _, y in loader]), val[1])


def test_a_data_root_that_is_a_file_is_one_usage_error(tmp_path):
    """It was FileExistsError from the download's mkdir: a traceback, exit 1."""
    from src.data import ensure_file

    root = tmp_path / "a-file"
    root.write_text("")
    cfg = DataConfig(name="vesselmnist3d", root=str(root), num_classes=2, task="binary-class")
    with pytest.raises(UsageError, match=r"^data.root=.*a-file cannot be written \(File exists\): give a folder"):
        ensure_file(cfg)
