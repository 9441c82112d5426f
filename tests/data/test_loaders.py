"""The splits as tensors and the loaders over them (:mod:`src.data.loaders`), on the real shipped files: shapes,
seeded orders that vary by epoch, the tensor loader and DataLoader in agreement, evaluation in order."""

from __future__ import annotations

import pytest
import torch

from src.config import DataConfig, Loader
from src.data.loaders import SeededPermutation, TensorLoader, load_splits, make_loader
from tests.data.helpers import adrenal


@pytest.mark.parametrize("size", [28, 64])
def test_real_files_load_with_their_shapes(shared_data, size):
    splits = load_splits(adrenal(shared_data, size=size, download=False))
    assert {k: len(v[1]) for k, v in splits.items()} == {"train": 1188, "val": 98, "test": 298}
    images, labels = splits["train"]
    assert images.shape == (1188, 1, size, size, size) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64 and set(labels.tolist()) == {0, 1}


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


def test_rank_shards_together_are_the_single_process_batches():
    whole = SeededPermutation(101, seed=5).order()
    shards = [SeededPermutation(101, seed=5, rank=r, world=2).order() for r in range(2)]
    assert [len(s) for s in shards] == [50, 50]
    for step in range(6):  # batch 8 per rank == batch 16 in one process, as sets
        ranks = torch.cat([s[8 * step : 8 * step + 8] for s in shards])
        assert sorted(ranks.tolist()) == sorted(whole[16 * step : 16 * step + 16].tolist())


@pytest.mark.parametrize(("n", "batch"), [(41, 3), (1335, 4), (101, 8), (1188, 4)])
def test_ranks_take_the_single_process_steps_and_no_sample_twice(n, batch):
    """An odd split at 2 ranks: 1,335 (VesselMNIST3D) at 2 x 4 took 167 steps, one sample twice, where one process
    at 8 takes 166."""
    one = TensorLoader(torch.arange(n), torch.arange(n), 2 * batch, SeededPermutation(n, 3), drop_last=True)
    ranks = [
        TensorLoader(torch.arange(n), torch.arange(n), batch, SeededPermutation(n, 3, rank=r, world=2), drop_last=True)
        for r in range(2)
    ]
    assert len(ranks[0]) == len(ranks[1]) == len(one)
    for whole, *shards in zip(one, *ranks, strict=True):
        assert sorted(torch.cat([images for images, _ in shards]).tolist()) == sorted(whole[0].tolist())
