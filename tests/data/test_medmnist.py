"""MedMNIST's official files (:mod:`src.data.medmnist`) on the real shipped files: checksums, a file of another
size or set named, its INFO entry against the config, and the download path (a local HTTP server)."""

from __future__ import annotations

import dataclasses
import functools
import http.server
import os
import shutil
import threading

import numpy as np
import pytest
from medmnist import INFO

import src.data.medmnist
from src.config import DataConfig
from src.data.files import check_file, npz_path
from src.data.loaders import load_splits
from src.errors import UsageError
from tests.data.helpers import REDOWNLOAD, adrenal, refusal


def test_missing_file_without_download_names_the_fix(tmp_path):
    with pytest.raises(
        UsageError, match=r"adrenalmnist3d\.npz not found and data\.download=false: set data\.download=true"
    ):
        load_splits(adrenal(tmp_path, download=False))


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
        f"{bad} has MD5 {src.data.medmnist.file_md5(bad)}, expected {INFO['adrenalmnist3d']['MD5']}: "
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
    hashed, hash_file = [], src.data.medmnist.file_md5
    monkeypatch.setattr(src.data.medmnist, "file_md5", lambda path: hashed.append(path) or hash_file(path))
    cfg = adrenal(tmp_path, download=False)
    assert [check_file(cfg) for _ in range(3)] == [True] * 3 and len(hashed) == 1
    stat = npz_path(cfg).stat()
    os.utime(npz_path(cfg), ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert check_file(cfg) and len(hashed) == 2


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


def test_medmnist_keys_that_do_not_fit_the_dataset_name_its_values(shared_data):
    for key, value, held in (("num_classes", 3, 2), ("in_channels", 3, 1), ("task", "multi-class", "binary-class")):
        multi = {"task": "multi-class"} if key == "num_classes" else {}  # binary-class takes 2 classes only
        cfg = dataclasses.replace(adrenal(shared_data, download=False), **{key: value}, **multi)
        assert refusal(load_splits, cfg) == (
            f"data.{key}={value} does not fit adrenalmnist3d: its files hold {held}: set data.{key}={held}"
        )
