"""MedMNIST's official 3D files: medmnist's catalogue (``INFO``), each file's MD5 (hashed once per version of the file),
a file checked against its entry, and its download (verified before it takes its name)."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import shutil
import urllib.request
from pathlib import Path

from src.atomic import atomic_path
from src.config import NIFTI, SYNTHETIC, DataConfig
from src.data.names import REDOWNLOAD, npz_name
from src.errors import UsageError
from src.redaction import reveal

log = logging.getLogger(__name__)

MD5S: dict[tuple[Path, int, int, int], str] = {}  # (path, size, mtime_ns, inode) -> MD5, this process's hashes


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


def check_official(cfg: DataConfig, path: Path) -> bool:
    """Whether the official file for ``cfg`` is at ``path`` (False: missing, to download), its MD5 and ``cfg``'s
    classes, channels and task checked against its INFO entry; writes nothing."""
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


def download(cfg: DataConfig, path: Path) -> None:
    """Fetch the official file (or ``data.url``) to ``path`` atomically, then verify its MD5."""
    info = medmnist_info(cfg)
    url = reveal(cfg.url) if cfg.url else info["url" if cfg.size == 28 else f"url_{cfg.size}"]  # a token put back
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
            f"download of {url} failed ({err}): check the network, or put {npz_name(cfg.name, cfg.size)} "
            f"in data.root={cfg.root} and set data.download=false; or run now on a set that ships in data/medmnist "
            "(data=adrenalmnist3d, data=vesselmnist3d) or on data=synthetic"
        ) from None
