"""What the data tests share: the configs of the shipped AdrenalMNIST3D file and of a small synthetic task, the fixes
their refusals name, and a refusal's one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from src.config import DataConfig
from src.errors import UsageError

REDOWNLOAD = "delete it and rerun with data.download=true"
REGENERATE = "delete it (data=synthetic regenerates it from a fixed seed)"


def adrenal(root: Path, **kw) -> DataConfig:
    return DataConfig(name="adrenalmnist3d", root=str(root), num_classes=2, task="binary-class", **kw)


def synthetic(root: Path, **kw) -> DataConfig:
    return DataConfig(name="synthetic", root=str(root), num_classes=2, synthetic_samples=[8, 4, 4], **kw)


def refusal(load, *args) -> str:
    """The one-line message of the :class:`UsageError` ``load(*args)`` raises."""
    with pytest.raises(UsageError) as err:
        load(*args)
    assert "\n" not in str(err.value)
    return str(err.value)
