"""MedMNIST loading on the real files, checksums, the download path (local HTTP server), synthetic data, loaders."""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from src.config import DataConfig, Loader
from src.data import load_splits, make_loader, npz_path
from src.errors import UsageError


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


def test_wrong_checksum_is_refused(tmp_path, shared_data):
    bad = tmp_path / "adrenalmnist3d.npz"
    shutil.copy(shared_data / "vesselmnist3d.npz", bad)
    with pytest.raises(
        UsageError, match="has MD5 b41fd4f7e7e2feedddb201585ecafa1b, expected bbd3c5a5576322bc4cdfea780653b1ce"
    ):
        load_splits(adrenal(tmp_path, download=False))


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


def test_download_failure_is_one_clear_line(tmp_path, http_root):
    _, base = http_root
    with pytest.raises(UsageError, match=r"download of .*missing.npz failed .*: check the network"):
        load_splits(adrenal(tmp_path, url=f"{base}/missing.npz"))


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
    assert all(torch.equal(a[1], b[1]) for a, b in zip(first, again))
    assert not torch.equal(first[0][1], other_epoch[0][1])
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, batches(standard, 0)))
    reseeded = make_loader(cfg, train, 64, seed=4, train=True, device=torch.device("cpu"))
    assert not torch.equal(first[0][1], batches(reseeded, 0)[0][1])


def test_evaluation_loaders_keep_order_and_every_sample(shared_data):
    cfg = adrenal(shared_data, download=False)
    val = load_splits(cfg)["val"]
    loader = make_loader(cfg, val, 32, seed=0, train=False, device=torch.device("cpu"))
    assert torch.equal(torch.cat([y for _, y in loader]), val[1])
