"""What each kind of data file is named, and how a bad one is replaced, told by its name. No third-party import:
``src/__init__`` reaches it (through :mod:`src.data.shipped`) in every command, before its config is checked."""

from __future__ import annotations

from pathlib import Path

from src.config import NIFTI, SYNTHETIC

REDOWNLOAD = "delete it and rerun with data.download=true"
REGENERATE = "delete it (data=synthetic regenerates it from a fixed seed)"
REBUILD = "delete it (data=nifti builds it again from the volumes)"


def npz_name(flag: str, size: int) -> str:
    """medmnist's file name: ``<flag>[_<size>].npz``."""
    return f"{flag}{'' if size == 28 else f'_{size}'}.npz"


def replace_fix(path: Path) -> str:
    """How to replace a bad file: a synthetic one (named ``synthetic_*`` by :func:`src.data.files.npz_path`) is
    regenerated, a NIfTI folder's cache (``nifti_*``) built again, a MedMNIST one downloaded again."""
    if path.name.startswith(f"{NIFTI}_"):
        return REBUILD
    return REGENERATE if path.name.startswith(f"{SYNTHETIC}_") else REDOWNLOAD
