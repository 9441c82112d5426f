"""3D DenseNets 121-264 (Huang et al.; the MONAI layout), optionally memory-efficient (Pleiss et al.)."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from src.config import Init, InitMode, Stem
from src.models.layers import HalvingAvgPool3d, Layers, init_weights
from src.models.registry import register_model


@contextlib.contextmanager
def kept_buffers(module: nn.Module) -> Iterator[None]:
    """Restore ``module``'s buffers on exit, so a recomputed BatchNorm does not update its running stats twice."""
    saved = [buffer.clone() for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(module.buffers(), saved, strict=True):
                buffer.copy_(value)


def recomputed(
    module: nn.Module, function: Callable[..., torch.Tensor], norm: nn.Module, *inputs: torch.Tensor
) -> torch.Tensor:
    """``function(*inputs)``; when ``module.checkpointing`` applies (training, grad enabled), its activations
    are not stored but recomputed in backward (``use_reentrant=False``), leaving ``norm``'s running stats alone."""
    if not (module.checkpointing and module.training and torch.is_grad_enabled()):
        return function(*inputs)
    return checkpoint(
        function, *inputs, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), kept_buffers(norm))
    )


class DenseLayer(nn.Module):
    """norm, act, 1^3 conv to ``bn_size * growth_rate``, norm, act, 3^3 conv to ``growth_rate`` new maps.

    With ``checkpointing`` the concat-norm-act-1^3 conv bottleneck is recomputed in backward
    (:func:`recomputed`), which is Pleiss et al.'s memory-efficient DenseNet.
    """

    def __init__(self, in_channels: int, growth_rate: int, bn_size: int, layers: Layers, checkpointing: bool) -> None:
        super().__init__()
        width = bn_size * growth_rate
        self.norm1 = layers.norm(in_channels)
        self.act1 = layers.act(in_channels)
        self.conv1 = layers.conv(in_channels, width)
        self.norm2 = layers.norm(width)
        self.act2 = layers.act(width)
        self.conv2 = layers.conv(width, growth_rate, 3)
        self.checkpointing = checkpointing

    def bottleneck(self, *features: torch.Tensor) -> torch.Tensor:
        return self.conv1(self.act1(self.norm1(torch.cat(features, 1))))

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        out = recomputed(self, self.bottleneck, self.norm1, *features)
        return self.conv2(self.act2(self.norm2(out)))


class Transition(nn.Sequential):
    """norm, act, 1^3 conv, 2^3 average pool; with ``checkpointing`` the norm-act-conv is recomputed in
    backward like a dense layer's bottleneck (it is the same concat-norm-act-1^3 conv pattern)."""

    def __init__(self, in_channels: int, out_channels: int, layers: Layers, checkpointing: bool) -> None:
        super().__init__(
            OrderedDict(
                norm=layers.norm(in_channels),
                act=layers.act(in_channels),
                conv=layers.conv(in_channels, out_channels),
                pool=HalvingAvgPool3d(),
            )
        )
        self.checkpointing = checkpointing

    def squeeze(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.act(self.norm(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(recomputed(self, self.squeeze, self.norm, x))


class DenseBlock(nn.ModuleList):
    """Dense layers, each fed the concatenation of the block input and every earlier layer's maps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self:
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet3D(nn.Sequential):
    """Stages ``stem, block1, transition1, ..., block4, head`` (head: norm, act, global pool, linear); every stem
    runs at 28^3 (layout and design: docs/architecture.md).

    Args:
        block_config: dense layers per block.
        in_channels: input channels.
        num_classes: logits.
        stem: the stem (resolved: not ``auto``).
        layers: builds every activation, norm and conv.
        init, init_mode: weight initialisation.
        checkpointing: recompute every dense layer's bottleneck and every transition's norm-act-conv in backward
            instead of storing them.
        growth_rate: maps each dense layer adds.
        init_features: stem channels.
        bn_size: bottleneck width in units of ``growth_rate``.
        compression: channel fraction a transition keeps.
    """

    def __init__(
        self,
        block_config: Sequence[int],
        in_channels: int,
        num_classes: int,
        stem: Stem,
        layers: Layers,
        init: Init,
        init_mode: InitMode,
        checkpointing: bool = False,
        growth_rate: int = 32,
        init_features: int = 64,
        bn_size: int = 4,
        compression: float = 0.5,
    ) -> None:
        stages = OrderedDict(stem=layers.stem(in_channels, init_features, stem))
        channels = init_features
        for index, num_layers in enumerate(block_config, 1):
            stages[f"block{index}"] = DenseBlock(
                DenseLayer(channels + i * growth_rate, growth_rate, bn_size, layers, checkpointing)
                for i in range(num_layers)
            )
            channels += num_layers * growth_rate
            if index < len(block_config):
                out_channels = int(channels * compression)
                stages[f"transition{index}"] = Transition(channels, out_channels, layers, checkpointing)
                channels = out_channels
        stages["head"] = layers.head(channels, num_classes, preact=True)
        super().__init__(stages)
        init_weights(self, init, init_mode, layers.activation)


RECOMPUTED = ("checkpointing",)  # the switch a DenseNet acts on beyond the layer switches


@register_model(RECOMPUTED)
def densenet121(**kwargs: Any) -> DenseNet3D:
    """DenseNet-121: blocks (6, 12, 24, 16)."""
    return DenseNet3D((6, 12, 24, 16), **kwargs)


@register_model(RECOMPUTED)
def densenet169(**kwargs: Any) -> DenseNet3D:
    """DenseNet-169: blocks (6, 12, 32, 32)."""
    return DenseNet3D((6, 12, 32, 32), **kwargs)


@register_model(RECOMPUTED)
def densenet201(**kwargs: Any) -> DenseNet3D:
    """DenseNet-201: blocks (6, 12, 48, 32)."""
    return DenseNet3D((6, 12, 48, 32), **kwargs)


@register_model(RECOMPUTED)
def densenet264(**kwargs: Any) -> DenseNet3D:
    """DenseNet-264: blocks (6, 12, 64, 48)."""
    return DenseNet3D((6, 12, 64, 48), **kwargs)
