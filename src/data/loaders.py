"""The splits a run trains on as tensors, and the loaders over them: seeded orders, sharded over ranks, on the device
(a split preloaded there, batches gathered by index) or through a DataLoader."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from src.config import DataConfig, Loader
from src.data.files import ensure_file
from src.data.npz import fitted, read_npz


def load_splits(cfg: DataConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Images as uint8 ``(N, C, D, H, W)`` tensors and labels as int64 ``(N,)``, checked against ``cfg``."""
    path = ensure_file(cfg)
    return {split: fitted(cfg, path, split, *arrays) for split, arrays in read_npz(path).items()}


def to_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 volumes to float in [-1, 1] (MedMNIST's normalisation: /255, mean 0.5, std 0.5)."""
    return images.float().div_(127.5).sub_(1.0)


class SeededPermutation(Sampler[int]):
    """A shuffled order fixed by ``(seed, epoch)``: reruns and resumed runs see the same batches.

    With ``world`` ranks, rank ``r`` takes every ``world``-th index from ``r`` of the one shared order, its
    last ``n mod world`` indices dropped (DistributedSampler's ``drop_last=True``; only training shards), so at
    every step the ranks' batches together are the single-process batch of ``world`` times the size, in as many
    steps (a padded order gave an extra step with a sample twice: VesselMNIST3D at 2 x 4).
    """

    def __init__(self, n: int, seed: int, shuffle: bool = True, rank: int = 0, world: int = 1) -> None:
        self.n, self.seed, self.shuffle, self.rank, self.world, self.epoch = n, seed, shuffle, rank, world, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch))
        else:
            order = torch.arange(self.n)
        return order[: len(self) * self.world][self.rank :: self.world]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())

    def __len__(self) -> int:
        return self.n // self.world


@dataclass
class TensorLoader:
    """Whole split preloaded on the device; batches are index gathers there (no worker, no copy)."""

    images: torch.Tensor
    labels: torch.Tensor
    batch_size: int
    sampler: SeededPermutation
    drop_last: bool

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.sampler.order().to(self.images.device)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            idx = order[start : start + self.batch_size]
            yield self.images[idx], self.labels[idx]

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


def train_labels(loader: TensorLoader | DataLoader) -> torch.Tensor:
    """Every label of the loader's split (all ranks' shards), as loaded."""
    return loader.labels if isinstance(loader, TensorLoader) else loader.dataset.tensors[1]


def make_loader(
    cfg: DataConfig,
    split: tuple[torch.Tensor, torch.Tensor],
    batch_size: int,
    seed: int,
    train: bool,
    device: torch.device,
    rank: int = 0,
    world: int = 1,
) -> TensorLoader | DataLoader:
    """A loader yielding uint8 image batches and labels; training order is seeded, sharded over ``world``
    ranks, and drops the last partial batch. Evaluation loaders are whole and in order."""
    images, labels = split
    sampler = SeededPermutation(len(labels), seed, shuffle=train, rank=rank, world=world if train else 1)
    if cfg.loader is Loader.tensor:
        return TensorLoader(images.to(device), labels.to(device), batch_size, sampler, drop_last=train)
    return DataLoader(
        TensorDataset(images, labels),
        batch_size=batch_size,
        sampler=sampler,
        drop_last=train,
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory and device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
    )
