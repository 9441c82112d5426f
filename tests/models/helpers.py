"""What the model tests share: the zoo's models at reduced width for real CPU runs, at full width on the meta device."""

from __future__ import annotations

import torch
from torch import nn

from src.config import Activation, DataConfig, ModelConfig, Norm
from src.models import MODELS, build_model, densenet3d, model_kwargs, resnet3d

NAMES = list(MODELS)
ACTIVATION_TYPES = {
    Activation.relu: nn.ReLU,
    Activation.swish: nn.SiLU,
    Activation.prelu: nn.PReLU,
    Activation.gelu: nn.GELU,
    Activation.mish: nn.Mish,
}
NORM_TYPES = {Norm.batch: nn.BatchNorm3d, Norm.group: nn.GroupNorm, Norm.instance: nn.InstanceNorm3d}
# reduced widths for real CPU runs, by the module a builder is in (another module's models run at full width)
REDUCED_WIDTHS = {
    resnet3d.__name__: {"widths": (2, 4, 8, 16)},
    densenet3d.__name__: {"growth_rate": 2, "init_features": 4},
}
# 3^3 convs inside the blocks: 2 per basic block, 1 per bottleneck, 1 per dense layer
BLOCK_SPATIAL_CONVS = {
    "resnet10": 8,
    "resnet18": 16,
    "resnet34": 32,
    "resnet50": 16,
    "resnet101": 33,
    "resnet152": 50,
    "resnet200": 66,
    "densenet121": 58,
    "densenet169": 82,
    "densenet201": 98,
    "densenet264": 130,
}
NUM_CLASSES = 3


def small_model(name: str, size: int = 28, in_channels: int = 1, **switches) -> nn.Module:
    """A registered model at reduced width (same depth and switches) for real CPU runs."""
    build = MODELS[name].build
    data = DataConfig(name="synthetic", size=size, in_channels=in_channels, num_classes=NUM_CLASSES)
    return build(**model_kwargs(ModelConfig(name=name, **switches), data), **REDUCED_WIDTHS.get(build.__module__, {}))


def meta_model(name: str, size: int = 28, **switches) -> nn.Module:
    """A registered model at full width on the meta device (for counts and shapes)."""
    with torch.device("meta"):
        return build_model(ModelConfig(name=name, **switches), DataConfig(name="synthetic", size=size, num_classes=2))


def meta_input(size: int) -> torch.Tensor:
    return torch.empty(1, 1, size, size, size, device="meta")
