"""The model zoo: 3D ResNets and DenseNets behind one registry and :func:`build_model`."""

from __future__ import annotations

from typing import Any

from torch import nn

from src.config import DataConfig, ModelConfig
from src.models import resnet3d  # noqa: F401  (registers the ResNets, then the DenseNets: preset=models' order)

# isort: split
from src.models import densenet3d  # noqa: F401
from src.models.layers import Layers, resolve_stem
from src.models.registry import MODELS, check_model

__all__ = ["MODELS", "build_model", "check_model", "model_kwargs"]


def build_model(cfg: ModelConfig, data: DataConfig) -> nn.Module:
    """Build ``cfg.name`` at its standard widths for ``data``'s channels, classes and size (the size resolves
    ``stem=auto``).

    Raises:
        ValueError: ``cfg.name`` is not registered.
    """
    if cfg.name not in MODELS:
        raise ValueError(f"unknown model.name={cfg.name!r}; valid names: {', '.join(MODELS)}")
    return MODELS[cfg.name].build(**model_kwargs(cfg, data))


def model_kwargs(cfg: ModelConfig, data: DataConfig) -> dict[str, Any]:
    """The plain values ``cfg.name`` takes: the layer switches, and the switches it declares (registry)."""
    layers = Layers(cfg.activation, cfg.norm, cfg.dsconv, cfg.dsconv_mid_norm, cfg.inplace_act)
    return {
        "in_channels": data.in_channels,
        "num_classes": data.num_classes,
        "stem": resolve_stem(cfg.stem, data.size),
        "layers": layers,
        "init": cfg.init,
        "init_mode": cfg.init_mode,
        **{switch: getattr(cfg, switch) for switch in MODELS[cfg.name].switches},
    }
