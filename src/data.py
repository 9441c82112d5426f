"""MedMNIST 3D data: checked `.npz` loading, download, a synthetic task, and seeded loaders."""

from __future__ import annotations

import hashlib
import logging
import shutil
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from src.atomic import atomic_path
from src.config import DataConfig, Loader
from src.errors import UsageError

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
SYNTHETIC = "synthetic"


def npz_path(cfg: DataConfig) -> Path:
    """Where the file for ``cfg`` lives: ``<root>/<flag>[_<size>].npz``, medmnist's naming."""
    suffix = "" if cfg.size == 28 else f"_{cfg.size}"
    name = cfg.name if cfg.name != SYNTHETIC else f"{SYNTHETIC}_{'-'.join(map(str, cfg.synthetic_samples))}"
    return Path(cfg.root).expanduser() / f"{name}{suffix}.npz"


def medmnist_info(cfg: DataConfig) -> dict:
    """medmnist's INFO entry for ``cfg.name``; a clear error for an unknown flag."""
    from medmnist import INFO

    flags = sorted(k for k in INFO if k.endswith("3d")) + [SYNTHETIC]
    if cfg.name not in INFO or not cfg.name.endswith("3d"):
        raise UsageError(f"data.name={cfg.name} is not a MedMNIST 3D dataset: use one of {', '.join(flags)}")
    return INFO[cfg.name]


def md5(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def expected_md5(cfg: DataConfig) -> str:
    return medmnist_info(cfg)["MD5" if cfg.size == 28 else f"MD5_{cfg.size}"]


def download(cfg: DataConfig, path: Path) -> None:
    """Fetch the official file (or ``data.url``) to ``path`` atomically, then verify its MD5."""
    info = medmnist_info(cfg)
    url = cfg.url or info["url" if cfg.size == 28 else f"url_{cfg.size}"]
    log.info("downloading %s -> %s", url, path)
    with atomic_path(path) as partial:
        fetch(url, partial, cfg)
        got, want = md5(partial), expected_md5(cfg)
        if got != want:
            raise UsageError(
                f"downloaded {url} has MD5 {got}, expected {want}: retry, or set data.url to a good mirror"
            )


def fetch(url: str, to: Path, cfg: DataConfig) -> None:
    try:
        with urllib.request.urlopen(url, timeout=60) as response, to.open("wb") as out:
            shutil.copyfileobj(response, out)
    except OSError as err:
        raise UsageError(
            f"download of {url} failed ({err}): check the network, or put {npz_path(cfg).name} "
            f"in data.root={cfg.root} and set data.download=false"
        ) from None


def ensure_file(cfg: DataConfig) -> Path:
    """Return the verified `.npz` for ``cfg``, downloading or generating it when missing."""
    path = npz_path(cfg)
    if check_file(cfg):
        return path
    if cfg.name == SYNTHETIC:
        write_synthetic(cfg, path)
    else:
        download(cfg, path)  # it checks the MD5
    return path


def check_file(cfg: DataConfig) -> bool:
    """Whether the verified `.npz` for ``cfg`` is there (False: :func:`ensure_file` will download or generate it);
    raises what :func:`ensure_file` would refuse, writing nothing (a dry run checks the data this way)."""
    path = npz_path(cfg)
    if cfg.name == SYNTHETIC:
        return path.exists()
    medmnist_info(cfg)
    if not path.exists():
        if not cfg.download:
            raise UsageError(
                f"{path} not found and data.download=false: set data.download=true, "
                f"or data.root=<folder that holds {path.name}>"
            )
        return False
    got, want = md5(path), expected_md5(cfg)
    if got != want:
        raise UsageError(
            f"{path} has MD5 {got}, expected {want} (corrupt or partial file): "
            f"delete it and rerun with data.download=true"
        )
    return True


def split_sizes(cfg: DataConfig) -> dict[str, int]:
    """Samples per split, known without the file: medmnist's INFO (the file's MD5 is checked against the same entry),
    or ``data.synthetic_samples`` (which name the synthetic file)."""
    if cfg.name == SYNTHETIC:
        return dict(zip(SPLITS, cfg.synthetic_samples))
    return {split: medmnist_info(cfg)["n_samples"][split] for split in SPLITS}


def read_npz(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{split: (images uint8 (N, D, H, W) or (N, C, D, H, W), labels int64 (N,))}``."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {s: (npz[f"{s}_images"], npz[f"{s}_labels"].reshape(-1).astype(np.int64)) for s in SPLITS}
    except (KeyError, ValueError, OSError, zipfile.BadZipFile) as err:
        raise UsageError(
            f"{path} is not a MedMNIST .npz ({err}): delete it and rerun with data.download=true"
        ) from None


def write_synthetic(cfg: DataConfig, path: Path) -> None:
    """A learnable 3D task in MedMNIST's format: class 0 a ball, class 1 a cube, noisy, random pose.

    Generated from a fixed seed (independent of the training seed), so every run sees the same data.
    """
    rng = np.random.default_rng(12345)
    s = cfg.size
    grid = np.stack(np.meshgrid(*[np.arange(s)] * 3, indexing="ij"), axis=-1).astype(np.float32)
    arrays = {}
    for split, n in zip(SPLITS, cfg.synthetic_samples):
        labels = rng.integers(0, cfg.num_classes, size=(n, 1)).astype(np.uint8)
        images = np.empty((n, s, s, s), np.uint8)
        for i, label in enumerate(labels[:, 0]):
            centre = rng.uniform(0.35 * s, 0.65 * s, size=3)
            radius = rng.uniform(0.15 * s, 0.25 * s)
            offset = grid - centre
            dist = np.sqrt((offset**2).sum(-1)) if label == 0 else np.abs(offset).max(-1) / (1 + 0.2 * (label - 1))
            shape = (dist <= radius).astype(np.float32)
            images[i] = np.clip(200 * shape + rng.normal(30, 25, size=(s, s, s)), 0, 255).astype(np.uint8)
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = images, labels
    with atomic_path(path) as partial, partial.open("wb") as out:
        np.savez_compressed(out, **arrays)


def load_splits(cfg: DataConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Images as uint8 ``(N, C, D, H, W)`` tensors and labels as int64 ``(N,)``, checked against ``cfg``."""
    path = ensure_file(cfg)
    splits = {}
    for split, (images, labels) in read_npz(path).items():
        x = torch.from_numpy(images)
        x = x.unsqueeze(1) if x.ndim == 4 else x
        if tuple(x.shape[1:]) != (cfg.in_channels, cfg.size, cfg.size, cfg.size):
            raise UsageError(
                f"{path} holds {split} images of shape {tuple(x.shape[1:])}, expected "
                f"{(cfg.in_channels, cfg.size, cfg.size, cfg.size)}: check data.size and data.in_channels"
            )
        splits[split] = (x, torch.from_numpy(labels))
    return splits


def to_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 volumes to float in [-1, 1] (MedMNIST's normalisation: /255, mean 0.5, std 0.5)."""
    return images.float().div_(127.5).sub_(1.0)


class SeededPermutation(Sampler[int]):
    """A shuffled order fixed by ``(seed, epoch)``: reruns and resumed runs see the same batches.

    With ``world`` ranks, rank ``r`` takes every ``world``-th index from ``r`` of the one shared order
    (padded from its start to a multiple of ``world``, as DistributedSampler does), so at every step the
    ranks' batches together are the single-process batch of ``world`` times the size.
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
        padded = torch.cat([order, order[: len(self) * self.world - self.n]])
        return padded[self.rank :: self.world]

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())

    def __len__(self) -> int:
        return -(-self.n // self.world)


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
