"""The model zoo: 3D ResNets and DenseNets behind one registry and :func:`build_model`."""
from __future__ import annotations

from torch import nn

from src.config import ModelConfig
from src.models import densenet3d, resnet3d  # noqa: F401  (registers the models)
from src.models.registry import MODELS

__all__ = ["MODELS", "build_model"]


def build_model(cfg: ModelConfig, in_channels: int, num_classes: int, size: int) -> nn.Module:
    """Build ``cfg.name`` at its standard widths for ``size``^3 inputs (``size`` only resolves ``stem=auto``).

    Raises:
        ValueError: ``cfg.name`` is not registered.
    """
    if cfg.name not in MODELS:
        raise ValueError(f"unknown model.name={cfg.name!r}; valid names: {', '.join(MODELS)}")
    return MODELS[cfg.name](cfg=cfg, in_channels=in_channels, num_classes=num_classes, size=size)
