"""3D ResNets 10-200 in the MedicalNet / MONAI layout (stride on the 3^3 conv, shortcut A or B)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from src.config import Init, InitMode, Shortcut, Stem
from src.models.layers import Layers, init_weights
from src.models.registry import register_model


class ZeroPadShortcut(nn.Module):
    """Shortcut type A: the identity subsampled by ``stride``, zero-padded to ``out_channels``.

    Gradient flows through it; MedicalNet and MONAI detach this identity (``out.data``), which we do not copy.
    """

    def __init__(self, out_channels: int, stride: int) -> None:
        super().__init__()
        self.out_channels, self.stride = out_channels, stride

    def extra_repr(self) -> str:
        return f"out_channels={self.out_channels}, stride={self.stride}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stride
        x = x[:, :, ::s, ::s, ::s]
        return F.pad(x, (0, 0, 0, 0, 0, 0, 0, self.out_channels - x.shape[1]))


class ResidualBlock(nn.Module):
    """``act(branch(x) + shortcut(x))``; subclasses build the branch, whose last module is its last norm.

    The shortcut is the identity when the shape is kept, else type A (:class:`ZeroPadShortcut`) or type B
    (1^3 conv with the stride, then norm; the conv has no bias, unlike MONAI's ``bias_downsample=True``).
    """

    expansion: int

    def __init__(self, in_channels: int, planes: int, stride: int, layers: Layers, shortcut: Shortcut) -> None:
        super().__init__()
        out_channels = planes * self.expansion
        self.branch = self.make_branch(in_channels, planes, stride, layers)
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = (
                ZeroPadShortcut(out_channels, stride)
                if shortcut is Shortcut.A
                else nn.Sequential(
                    OrderedDict(conv=layers.conv(in_channels, out_channels, 1, stride), norm=layers.norm(out_channels))
                )
            )
        self.act = layers.act(out_channels)

    @staticmethod
    def make_branch(in_channels: int, planes: int, stride: int, layers: Layers) -> nn.Sequential:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        return self.act(self.branch(x) + identity)


class BasicBlock(ResidualBlock):
    """Two 3^3 convs (the first carries the stride), ``planes`` wide."""

    expansion = 1

    @staticmethod
    def make_branch(in_channels: int, planes: int, stride: int, layers: Layers) -> nn.Sequential:
        return nn.Sequential(
            OrderedDict(
                conv1=layers.conv(in_channels, planes, 3, stride),
                norm1=layers.norm(planes),
                act1=layers.act(planes),
                conv2=layers.conv(planes, planes, 3),
                norm2=layers.norm(planes),
            )
        )


class Bottleneck(ResidualBlock):
    """1^3 reduce to ``planes``, 3^3 with the stride, 1^3 expand to ``4 * planes``."""

    expansion = 4

    @staticmethod
    def make_branch(in_channels: int, planes: int, stride: int, layers: Layers) -> nn.Sequential:
        out_channels = planes * Bottleneck.expansion
        return nn.Sequential(
            OrderedDict(
                conv1=layers.conv(in_channels, planes),
                norm1=layers.norm(planes),
                act1=layers.act(planes),
                conv2=layers.conv(planes, planes, 3, stride),
                norm2=layers.norm(planes),
                act2=layers.act(planes),
                conv3=layers.conv(planes, out_channels),
                norm3=layers.norm(out_channels),
            )
        )


class ResNet3D(nn.Sequential):
    """Stages ``stem, layer1..layer4, head``; ``layer2..4`` halve the map with their first block.

    Args:
        block: :class:`BasicBlock` or :class:`Bottleneck`.
        depths: blocks per stage.
        in_channels: input channels.
        num_classes: logits.
        stem: the stem (resolved: not ``auto``).
        layers: builds every activation, norm and conv.
        init, init_mode: weight initialisation.
        shortcut: the projection of a block that changes shape (A: zero-padded identity, B: 1^3 conv).
        zero_init_residual: each block's last norm starts at zero (the block starts as its shortcut).
        widths: stage widths before the block expansion; the stem has ``widths[0]`` channels.
    """

    def __init__(
        self,
        block: type[ResidualBlock],
        depths: Sequence[int],
        in_channels: int,
        num_classes: int,
        stem: Stem,
        layers: Layers,
        init: Init,
        init_mode: InitMode,
        shortcut: Shortcut = Shortcut.B,
        zero_init_residual: bool = False,
        widths: Sequence[int] = (64, 128, 256, 512),
    ) -> None:
        stages = OrderedDict(stem=layers.stem(in_channels, widths[0], stem))
        channels = widths[0]
        for index, (depth, width) in enumerate(zip(depths, widths, strict=True)):
            blocks = []
            for position in range(depth):
                stride = 2 if index > 0 and position == 0 else 1
                blocks.append(block(channels, width, stride, layers, shortcut))
                channels = width * block.expansion
            stages[f"layer{index + 1}"] = nn.Sequential(*blocks)
        stages["head"] = layers.head(channels, num_classes)
        super().__init__(stages)
        init_weights(self, init, init_mode, layers.activation)
        if zero_init_residual:
            for module in self.modules():
                if isinstance(module, ResidualBlock):
                    nn.init.zeros_(module.branch[-1].weight)


RESIDUAL = ("shortcut", "zero_init_residual")  # the switches a ResNet acts on beyond the layer switches


@register_model(RESIDUAL)
def resnet10(**kwargs: Any) -> ResNet3D:
    """ResNet-10: basic blocks (1, 1, 1, 1)."""
    return ResNet3D(BasicBlock, (1, 1, 1, 1), **kwargs)


@register_model(RESIDUAL)
def resnet18(**kwargs: Any) -> ResNet3D:
    """ResNet-18: basic blocks (2, 2, 2, 2)."""
    return ResNet3D(BasicBlock, (2, 2, 2, 2), **kwargs)


@register_model(RESIDUAL)
def resnet34(**kwargs: Any) -> ResNet3D:
    """ResNet-34: basic blocks (3, 4, 6, 3)."""
    return ResNet3D(BasicBlock, (3, 4, 6, 3), **kwargs)


@register_model(RESIDUAL)
def resnet50(**kwargs: Any) -> ResNet3D:
    """ResNet-50: bottlenecks (3, 4, 6, 3)."""
    return ResNet3D(Bottleneck, (3, 4, 6, 3), **kwargs)


@register_model(RESIDUAL)
def resnet101(**kwargs: Any) -> ResNet3D:
    """ResNet-101: bottlenecks (3, 4, 23, 3)."""
    return ResNet3D(Bottleneck, (3, 4, 23, 3), **kwargs)


@register_model(RESIDUAL)
def resnet152(**kwargs: Any) -> ResNet3D:
    """ResNet-152: bottlenecks (3, 8, 36, 3)."""
    return ResNet3D(Bottleneck, (3, 8, 36, 3), **kwargs)


@register_model(RESIDUAL)
def resnet200(**kwargs: Any) -> ResNet3D:
    """ResNet-200: bottlenecks (3, 24, 36, 3)."""
    return ResNet3D(Bottleneck, (3, 24, 36, 3), **kwargs)
