"""The MedMNIST files that ship in ``data/medmnist`` (CC BY 4.0, attributed in its README), found there without a
``data.root``: ``conf/data/<flag>.yaml`` sets ``root: ${shipped:${.name},${.size}}``. ``src/__init__`` registers the
resolver, so every composition of ``conf/`` resolves it."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from src.config import DataConfig
from src.data.names import npz_name

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "medmnist"


def root(name: str, size: int) -> str:
    """``data/medmnist`` where it holds ``name`` at ``size``, else the download folder (DataConfig's default root)."""
    return str(SHIPPED) if (SHIPPED / npz_name(name, size)).is_file() else DataConfig.root


def register() -> None:
    """The resolver ``${shipped:<flag>,<size>}``: :func:`root`."""
    if not OmegaConf.has_resolver("shipped"):
        OmegaConf.register_new_resolver("shipped", root)
