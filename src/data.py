"""MedMNIST 3D data: checked `.npz` loading, download, a synthetic task, a NIfTI folder's cache (:mod:`src.volumes`),
and seeded loaders."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import shutil
import urllib.request
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from src import volumes
from src.atomic import atomic_path
from src.config import NIFTI, SPLITS, SYNTHETIC, DataConfig, Loader
from src.errors import UsageError

log = logging.getLogger(__name__)

REDOWNLOAD = "delete it and rerun with data.download=true"
REGENERATE = "delete it (data=synthetic regenerates it from a fixed seed)"
REBUILD = "delete it (data=nifti builds it again from the volumes)"
MD5S: dict[tuple[Path, int, int, int], str] = {}  # (path, size, mtime_ns, inode) -> MD5, this process's hashes
ARRAYS_CHECKED: set[tuple] = set()  # (path, size, mtime_ns, inode, config) of the synthetic files checked


def npz_name(flag: str, size: int) -> str:
    """medmnist's file name: ``<flag>[_<size>].npz``."""
    return f"{flag}{'' if size == 28 else f'_{size}'}.npz"


def content_params(cfg: DataConfig) -> dict[str, str]:
    """What a run's config cannot say of its data: a NIfTI folder's content (the cache's key: the CSV's rows, each
    file's size and time, the preprocessing keys), so a changed folder is another config; nothing for MedMNIST's
    files, checked against their MD5."""
    return {"data.content": npz_path(cfg).stem} if cfg.name == NIFTI else {}


def npz_path(cfg: DataConfig) -> Path:
    """Where the file for ``cfg`` lives: ``<root>/<flag>[_<size>].npz``, the synthetic flag named by its samples; a
    NIfTI folder's cache (:func:`src.volumes.cache_path`)."""
    if cfg.name == NIFTI:
        return volumes.cache_path(cfg, volumes.read_table(cfg))
    name = cfg.name if cfg.name != SYNTHETIC else f"{SYNTHETIC}_{'-'.join(map(str, cfg.synthetic_samples))}"
    return Path(cfg.root).expanduser() / npz_name(name, cfg.size)


def replace_fix(path: Path) -> str:
    """How to replace a bad file: a synthetic one (named ``synthetic_*`` by :func:`npz_path`) is regenerated, a NIfTI
    folder's cache (``nifti_*``) built again, a MedMNIST one downloaded again."""
    if path.name.startswith(f"{NIFTI}_"):
        return REBUILD
    return REGENERATE if path.name.startswith(f"{SYNTHETIC}_") else REDOWNLOAD


@functools.cache
def medmnist_catalogue() -> dict[str, dict]:
    """medmnist's ``INFO`` table, from its ``info`` module alone (which imports only the standard library): the
    package's ``__init__`` imports scikit-learn, ~1.5 s of a job's start-up that only the evaluation needs."""
    folder = Path(importlib.util.find_spec("medmnist").submodule_search_locations[0])
    spec = importlib.util.spec_from_file_location("medmnist.info", folder / "info.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.INFO


def flags_3d() -> list[str]:
    """medmnist's 3D flags, sorted."""
    return sorted(k for k in medmnist_catalogue() if k.endswith("3d"))


def medmnist_info(cfg: DataConfig) -> dict:
    """medmnist's INFO entry for ``cfg.name``; a clear error for an unknown flag."""
    if cfg.name not in flags_3d():
        flags = ", ".join(flags_3d() + [SYNTHETIC, NIFTI])
        raise UsageError(f"data.name={cfg.name} is not a MedMNIST 3D dataset: use one of {flags}")
    return medmnist_catalogue()[cfg.name]


def class_names(cfg: DataConfig) -> list[str]:
    """The class names in class order: the labels CSV's (``nifti``), MedMNIST's, or ``0``, ``1``... (``synthetic``)."""
    if cfg.name == NIFTI:
        return list(volumes.read_table(cfg).classes)
    if cfg.name == SYNTHETIC:
        return [str(k) for k in range(cfg.num_classes)]
    names = medmnist_info(cfg)["label"]
    return [names[str(k)] for k in range(cfg.num_classes)]


def md5(path: Path) -> str:
    """The file's MD5, hashed once per version of the file (path, size, mtime, inode) in this process."""
    stat = path.stat()
    key = (path.resolve(), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if key not in MD5S:
        MD5S[key] = file_md5(path)
    return MD5S[key]


def file_md5(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def md5_key(size: int) -> str:
    """The INFO key of the official file's MD5 at ``size``: ``MD5`` (28^3), ``MD5_64``, ..."""
    return "MD5" if size == 28 else f"MD5_{size}"


def expected_md5(cfg: DataConfig) -> str:
    return medmnist_info(cfg)[md5_key(cfg.size)]


def official_file(digest: str) -> tuple[str, int] | None:
    """The MedMNIST 3D (flag, size) whose official file has MD5 ``digest``, or None."""
    for flag in flags_3d():
        for key, value in medmnist_catalogue()[flag].items():
            if key.startswith("MD5") and value == digest:
                return flag, 28 if key == "MD5" else int(key.removeprefix("MD5_"))
    return None


def mismatch_fix(cfg: DataConfig, digest: str) -> str:
    """What a file with another MD5 than ``cfg``'s is and how to fix it: another official file is renamed and
    selected, anything else downloaded again."""
    known = official_file(digest)
    if known is None:
        return f"no official MedMNIST file (corrupt or partial): {REDOWNLOAD}"
    flag, size = known
    overrides = (("data", flag, cfg.name), ("data.size", size, cfg.size))
    select = " ".join(f"{key}={value}" for key, value, own in overrides if value != own)
    return f"it is {flag} at data.size={size}: rename it {npz_name(flag, size)} and set {select}, or {REDOWNLOAD}"


def download(cfg: DataConfig, path: Path) -> None:
    """Fetch the official file (or ``data.url``) to ``path`` atomically, then verify its MD5."""
    info = medmnist_info(cfg)
    url = cfg.url or info["url" if cfg.size == 28 else f"url_{cfg.size}"]
    log.info("downloading %s -> %s", url, path)
    with atomic_path(path) as partial:
        fetch(url, partial, cfg)
        got, want = file_md5(partial), expected_md5(cfg)
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
            f"in data.root={cfg.root} and set data.download=false; or run now on a set that ships in data/medmnist "
            "(data=adrenalmnist3d, data=vesselmnist3d) or on data=synthetic"
        ) from None


def ensure_file(cfg: DataConfig) -> Path:
    """Return the verified `.npz` for ``cfg``, downloading, generating or building (``nifti``) it when missing."""
    if cfg.name == NIFTI:
        return volumes.ensure(cfg)
    path = npz_path(cfg)
    if check_file(cfg):
        return path
    from src.folders import writable

    writable(path.parent, f"data.root={cfg.root}", "give a folder this process can write the file into")
    if cfg.name == SYNTHETIC:
        write_synthetic(cfg, path)
    else:
        download(cfg, path)  # it checks the MD5
    return path


def exists(path: Path) -> bool:
    """``path.exists()``, where an error other than its absence (a name too long, a folder that cannot be searched)
    is one line."""
    try:
        return path.exists()
    except OSError as err:
        raise UsageError(f"cannot read {path} ({err.strerror}): set data.root=<a folder that can be read>") from None


def check_file(cfg: DataConfig) -> bool:
    """Whether the verified `.npz` for ``cfg`` is there (False: :func:`ensure_file` will download or generate it);
    raises what :func:`ensure_file` or :func:`load_splits` would refuse, writing nothing (a dry run and a sweep's
    check of its jobs check the data this way). A MedMNIST file is verified by its MD5 and ``cfg`` against its INFO
    entry, a synthetic one by its arrays, a NIfTI folder by its CSV and its volumes' headers (``volumes.check``)."""
    if cfg.name == NIFTI:
        return volumes.check(cfg)
    path = npz_path(cfg)
    if exists(path) and not path.is_file():  # a FIFO would block the read for ever
        raise UsageError(f"{path} is not a file: {replace_fix(path)}")
    if cfg.name == SYNTHETIC:
        if path.exists():
            check_arrays(cfg, path)
        else:
            check_synthetic_memory(cfg)
        return path.exists()
    info = medmnist_info(cfg)
    if not path.exists():
        if not cfg.download:
            raise UsageError(
                f"{path} not found and data.download=false: set data.download=true, "
                f"or data.root=<folder that holds {path.name}>"
            )
        return False
    got, want = md5(path), expected_md5(cfg)
    if got != want:
        raise UsageError(f"{path} has MD5 {got}, expected {want}: {mismatch_fix(cfg, got)}")
    for key, value in (
        ("num_classes", len(info["label"])),
        ("in_channels", info["n_channels"]),
        ("task", info["task"]),
    ):
        if getattr(cfg, key) != value:
            raise UsageError(
                f"data.{key}={getattr(cfg, key)} does not fit {cfg.name}: its files hold {value}: "
                f"set data.{key}={value}"
            )
    return True


def check_arrays(cfg: DataConfig, path: Path) -> None:
    """A synthetic file's arrays against ``cfg`` (what :func:`load_splits` checks, and the samples its name gives),
    once per version of the file in this process."""
    stat = path.stat()
    key = (path.resolve(), stat.st_size, stat.st_mtime_ns, stat.st_ino, cfg.num_classes, cfg.in_channels, cfg.size)
    if key in ARRAYS_CHECKED:
        return
    for (split, (images, labels)), samples in zip(read_npz(path).items(), cfg.synthetic_samples, strict=True):
        fitted(cfg, path, split, images, labels)
        if len(labels) != samples:
            raise bad_split(path, split, f"{len(labels)} samples, expected {samples} (its name)", replace_fix(path))
    ARRAYS_CHECKED.add(key)


def split_sizes(cfg: DataConfig) -> dict[str, int]:
    """Samples per split, known without the file: medmnist's INFO (the file's MD5 is checked against the same entry),
    ``data.synthetic_samples`` (which name the synthetic file), or the labels CSV (``nifti``)."""
    if cfg.name == NIFTI:
        return volumes.read_table(cfg).sizes()
    if cfg.name == SYNTHETIC:
        return dict(zip(SPLITS, cfg.synthetic_samples, strict=True))
    return {split: medmnist_info(cfg)["n_samples"][split] for split in SPLITS}


def read_npz(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{split: (images uint8 (N, D, H, W) or (N, C, D, H, W), labels int64 (N,))}``, N >= 1; a file in another
    format is refused with the fix for its kind (:func:`replace_fix`)."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {s: (npz[f"{s}_images"], npz[f"{s}_labels"]) for s in SPLITS}
    except (KeyError, ValueError, OSError, EOFError, zlib.error, zipfile.BadZipFile) as err:  # EOFError: empty
        raise UsageError(f"{path} is not a MedMNIST .npz ({err}): {replace_fix(path)}") from None
    for split, (images, labels) in arrays.items():
        problem = format_problem(images, labels)
        if problem:
            raise bad_split(path, split, problem, replace_fix(path))
    return {s: (images, labels.reshape(-1).astype(np.int64)) for s, (images, labels) in arrays.items()}


def format_problem(images: np.ndarray, labels: np.ndarray) -> str | None:
    """What keeps a split from MedMNIST's format (uint8 volumes, one integer label each, a sample at least), or None;
    no pass over the voxels."""
    if images.dtype != np.uint8:
        return f"images of dtype {images.dtype}, expected uint8 (MedMNIST's format)"
    if images.ndim not in (4, 5):
        return f"images of shape {images.shape}, expected (N, D, H, W) or (N, C, D, H, W)"
    if not np.issubdtype(labels.dtype, np.integer):
        return f"labels of dtype {labels.dtype}, expected integers"
    if labels.shape not in ((len(images),), (len(images), 1)):
        return f"{len(images)} images but labels of shape {labels.shape}, expected one label per image"
    if not len(images):
        return "no samples, expected at least one"
    return None


def bad_split(path: Path, split: str, problem: str, fix: str) -> UsageError:
    """The one-line refusal of a split: the file, the split, what is wrong, the fix."""
    return UsageError(f"{path}, {split} split: {problem}: {fix}")


def check_synthetic_memory(cfg: DataConfig) -> None:
    """A :class:`UsageError` where the synthetic volumes ``cfg`` asks for (generated in memory, and trained on from
    there) exceed the memory this machine has free."""
    need, free = sum(cfg.synthetic_samples) * cfg.size**3, psutil.virtual_memory().available
    if need > free:
        raise UsageError(
            f"data.synthetic_samples={list(cfg.synthetic_samples)} at data.size={cfg.size} make {need / 2**30:.1f} GiB "
            f"of volumes, more than the {free / 2**30:.1f} GiB of memory free: lower data.synthetic_samples"
        )


def write_synthetic(cfg: DataConfig, path: Path) -> None:
    """A learnable 3D task in MedMNIST's format: class 0 a ball, class 1 a cube, noisy, random pose.

    Generated from a fixed seed (independent of the training seed), so every run sees the same data.
    """
    rng = np.random.default_rng(12345)
    s = cfg.size
    grid = np.stack(np.meshgrid(*[np.arange(s)] * 3, indexing="ij"), axis=-1).astype(np.float32)
    arrays = {}
    for split, n in zip(SPLITS, cfg.synthetic_samples, strict=True):
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
    return {split: fitted(cfg, path, split, *arrays) for split, arrays in read_npz(path).items()}


def fitted(
    cfg: DataConfig, path: Path, split: str, images: np.ndarray, labels: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """One split of :func:`read_npz` as tensors, its sample shape and label range checked against ``cfg``."""
    x = torch.from_numpy(images)
    x = x.unsqueeze(1) if x.ndim == 4 else x
    shape = (cfg.in_channels, cfg.size, cfg.size, cfg.size)
    if tuple(x.shape[1:]) != shape:
        problem = f"sample shape {tuple(x.shape[1:])}, expected {shape}"
        raise bad_split(path, split, problem, "check data.size and data.in_channels")
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= cfg.num_classes:
        problem = f"labels in [{low}, {high}], expected [0, {cfg.num_classes}) for data.num_classes={cfg.num_classes}"
        raise bad_split(path, split, problem, replace_fix(path))  # a MedMNIST file's classes: check_file
    return x, torch.from_numpy(labels)


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
