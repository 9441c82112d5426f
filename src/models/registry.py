"""The model registry: ``@register_model`` files a builder under its function name (as timm does)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Register ``builder`` as ``MODELS[builder.__name__]``; builders take the model class's keyword arguments."""
    MODELS[builder.__name__] = builder
    return builder
