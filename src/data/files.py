"""The file a config trains on, whatever its kind (a MedMNIST file, the synthetic task, a NIfTI folder's cache): where
it is, checked (writing nothing) or made when missing, and what is known of it without reading it: its classes, its
split sizes, and what a config hash must add to name its content."""

from __future__ import annotations

from pathlib import Path

from src.config import NIFTI, SPLITS, SYNTHETIC, DataConfig
from src.data.medmnist import check_official, download, medmnist_info
from src.data.names import npz_name, replace_fix
from src.data.nifti import cache
from src.data.nifti.table import read_table
from src.data.synthetic import check_synthetic, write_synthetic
from src.errors import UsageError
from src.folders import writable


def npz_path(cfg: DataConfig) -> Path:
    """Where the file for ``cfg`` lives: ``<root>/<flag>[_<size>].npz``, the synthetic flag named by its samples; a
    NIfTI folder's cache (:func:`src.data.nifti.cache.cache_path`)."""
    if cfg.name == NIFTI:
        return cache.cache_path(cfg, read_table(cfg))
    name = cfg.name if cfg.name != SYNTHETIC else f"{SYNTHETIC}_{'-'.join(map(str, cfg.synthetic_samples))}"
    return Path(cfg.root).expanduser() / npz_name(name, cfg.size)


def content_params(cfg: DataConfig) -> dict[str, str]:
    """What a run's config cannot say of its data: a NIfTI folder's content (the cache's key: the CSV's rows, each
    file's size and time, the preprocessing keys), so a changed folder is another config; nothing for MedMNIST's
    files, checked against their MD5."""
    return {"data.content": npz_path(cfg).stem} if cfg.name == NIFTI else {}


def class_names(cfg: DataConfig) -> list[str]:
    """The class names in class order: the labels CSV's (``nifti``), MedMNIST's, or ``0``, ``1``... (``synthetic``)."""
    if cfg.name == NIFTI:
        return list(read_table(cfg).classes)
    if cfg.name == SYNTHETIC:
        return [str(k) for k in range(cfg.num_classes)]
    names = medmnist_info(cfg)["label"]
    return [names[str(k)] for k in range(cfg.num_classes)]


def split_sizes(cfg: DataConfig) -> dict[str, int]:
    """Samples per split, known without the file: medmnist's INFO (the file's MD5 is checked against the same entry),
    ``data.synthetic_samples`` (which name the synthetic file), or the labels CSV (``nifti``)."""
    if cfg.name == NIFTI:
        return read_table(cfg).sizes()
    if cfg.name == SYNTHETIC:
        return dict(zip(SPLITS, cfg.synthetic_samples, strict=True))
    return {split: medmnist_info(cfg)["n_samples"][split] for split in SPLITS}


def exists(path: Path) -> bool:
    """``path.exists()``, where an error other than its absence (a name too long, a folder that cannot be searched)
    is one line."""
    try:
        return path.exists()
    except OSError as err:
        raise UsageError(f"cannot read {path} ({err.strerror}): set data.root=<a folder that can be read>") from None


def check_file(cfg: DataConfig) -> bool:
    """Whether the verified `.npz` for ``cfg`` is there (False: :func:`ensure_file` will download or generate it);
    raises what :func:`ensure_file` or :func:`src.data.loaders.load_splits` would refuse, writing nothing (a dry run
    and a sweep's check of its jobs check the data this way). A MedMNIST file is verified by its MD5 and ``cfg``
    against its INFO entry, a synthetic one by its arrays, a NIfTI folder by its CSV and its volumes' headers."""
    if cfg.name == NIFTI:
        return cache.check(cfg)
    path = npz_path(cfg)
    if exists(path) and not path.is_file():  # a FIFO would block the read for ever
        raise UsageError(f"{path} is not a file: {replace_fix(path)}")
    if cfg.name == SYNTHETIC:
        return check_synthetic(cfg, path)
    return check_official(cfg, path)


def ensure_file(cfg: DataConfig) -> Path:
    """Return the verified `.npz` for ``cfg``, downloading, generating or building (``nifti``) it when missing."""
    if cfg.name == NIFTI:
        return cache.ensure(cfg)
    path = npz_path(cfg)
    if check_file(cfg):
        return path
    writable(path.parent, f"data.root={cfg.root}", "give a folder this process can write the file into")
    if cfg.name == SYNTHETIC:
        write_synthetic(cfg, path)
    else:
        download(cfg, path)  # it checks the MD5
    return path
