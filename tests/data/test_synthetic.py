"""``data=synthetic``'s generated task (:mod:`src.data.synthetic`): MedMNIST's layout, learnable, the same on every
load, refused before any volume is made where it would not fit in memory."""

from __future__ import annotations

import numpy as np
import psutil
import pytest
import torch

from src.config import DataConfig
from src.data.files import check_file, npz_path
from src.data.loaders import load_splits
from tests.data.helpers import refusal


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
