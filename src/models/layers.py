"""The one place that turns the model switches into layers: activation, norm, conv, stem, head, init.

Every block of the zoo asks a :class:`Layers` for its modules, so ``activation``, ``norm`` and ``dsconv``
reach every position, and :func:`init_weights` is the single initialisation.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from src.config import Activation, Init, InitMode, Norm, Stem

NORMS = (nn.BatchNorm3d, nn.GroupNorm, nn.InstanceNorm3d)
PRELU_INIT = 0.25  # nn.PReLU's initial slope, also the slope its init gain assumes


def resolve_stem(stem: Stem, size: int) -> Stem:
    """``auto`` is ``small`` below 64^3 inputs and ``standard`` from 64^3; other stems pass through."""
    if stem is not Stem.auto:
        return stem
    return Stem.small if size < 64 else Stem.standard


def group_count(channels: int) -> int:
    """GroupNorm's groups: the largest divisor of ``channels`` that is at most 32."""
    return max(g for g in range(1, min(channels, 32) + 1) if channels % g == 0)


@functools.cache
def activation_gain(activation: Activation) -> float:
    """Init gain ``1 / sqrt(E[f(z)^2])`` for ``z ~ N(0, 1)``, so a layer keeps the second moment of its input.

    Computed once per activation by trapezoidal quadrature on [-12, 12] (step 1e-4, float64). It equals
    ``nn.init.calculate_gain`` for ReLU (``sqrt(2)``) and for PReLU at its initial slope 0.25
    (``calculate_gain("leaky_relu", 0.25)``) and extends the same rule to SiLU, GELU and Mish.
    """
    z = torch.linspace(-12.0, 12.0, 240_001, dtype=torch.float64, device="cpu")
    fz = {
        Activation.relu: F.relu,
        Activation.prelu: lambda t: F.leaky_relu(t, PRELU_INIT),
        Activation.swish: F.silu,
        Activation.gelu: F.gelu,
        Activation.mish: F.mish,
    }[activation](z)
    density = torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return 1.0 / math.sqrt(torch.trapezoid(fz * fz * density, z).item())


class Conv3d(nn.Conv3d):
    """``nn.Conv3d`` that zero-pads explicitly under CPU autocast on maps no larger than its kernel in some dim.

    PyTorch 2.13's CPU build (oneDNN 3.12) computes the bf16 weight gradient of such convs wrongly when the
    kernel pads them itself, up to inf/NaN and heap corruption: 3^3 convs on maps 2 deep, 7^3 stride-2 convs
    on maps under 7 (docs/benchmarks.md, "bf16 weight gradients on CPU"). The same conv on the padded map with
    no padding of its own is right, and stays in bf16.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and torch.is_autocast_enabled("cpu") and min(x.shape[2:]) <= max(self.kernel_size):
            padded = F.pad(x, [p for p in reversed(self.padding) for _ in range(2)])
            return F.conv3d(padded, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
        return super().forward(x)


class DepthwiseSeparableConv3d(nn.Sequential):
    """A k^3 conv split into a depthwise k^3 conv (carrying the stride) and a pointwise 1^3 conv.

    Forward FLOPs fall to ``1/C_out + 1/k^3`` of the dense conv's. ``mid`` (a norm and an activation) goes
    between the two when ``dsconv_mid_norm`` is set.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int,
        mid: tuple[nn.Module, nn.Module] | None,
    ) -> None:
        parts = OrderedDict(
            depthwise=Conv3d(
                in_channels, in_channels, kernel_size, stride, kernel_size // 2, groups=in_channels, bias=False
            )
        )
        if mid is not None:
            parts["norm"], parts["act"] = mid
        parts["pointwise"] = Conv3d(in_channels, out_channels, 1, bias=False)
        super().__init__(parts)


class HalvingAvgPool3d(nn.Module):
    """2^3 average pool with stride 2 that keeps a spatial dim below 2 as it is (kernel 1 there).

    A DenseNet transition then takes the 1^3 maps of DenseNet at 28^3 with the standard stem, where a
    plain ``AvgPool3d(2)`` (MONAI's) fails.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool3d(x, [min(2, s) for s in x.shape[2:]])


@dataclass(frozen=True)
class Layers:
    """Builds every activation, norm and conv of a model the way the config asks."""

    activation: Activation
    norm_kind: Norm
    dsconv: bool
    dsconv_mid_norm: bool
    inplace_act: bool = True

    def act(self, channels: int) -> nn.Module:
        """A fresh activation module for one position.

        ReLU runs in place unless ``inplace_act`` is off: its backward needs only its output, and it only ever
        follows a norm or a residual sum, whose outputs no other backward needs. SiLU and Mish stay out of place because
        their in-place forms make autograd keep a copy of the input anyway. PReLU learns one slope per
        channel (``num_parameters=channels``, initial slope 0.25).
        """
        if self.activation is Activation.prelu:
            return nn.PReLU(channels, init=PRELU_INIT)
        return {
            Activation.relu: lambda: nn.ReLU(inplace=self.inplace_act),
            Activation.swish: nn.SiLU,
            Activation.gelu: nn.GELU,
            Activation.mish: nn.Mish,
        }[self.activation]()

    def norm(self, channels: int) -> nn.Module:
        """BatchNorm3d, GroupNorm with :func:`group_count` groups, or affine InstanceNorm3d.

        InstanceNorm needs more than one voxel per map in training (PyTorch raises otherwise), so it does
        not fit the standard stem at 28^3, whose deepest maps are 1^3; use the small stem or GroupNorm.
        """
        if self.norm_kind is Norm.group:
            return nn.GroupNorm(group_count(channels), channels)
        if self.norm_kind is Norm.instance:
            return nn.InstanceNorm3d(channels, affine=True)
        return nn.BatchNorm3d(channels)

    def conv(self, in_channels: int, out_channels: int, kernel_size: int = 1, stride: int = 1) -> nn.Module:
        """A bias-free conv of a block (a norm follows each, possibly after a pool or concat), 'same' padding.

        With ``dsconv`` a spatial (k > 1) conv becomes a :class:`DepthwiseSeparableConv3d`; 1^3 convs stay.
        """
        if kernel_size > 1 and self.dsconv:
            mid = (self.norm(in_channels), self.act(in_channels)) if self.dsconv_mid_norm else None
            return DepthwiseSeparableConv3d(in_channels, out_channels, kernel_size, stride, mid)
        return Conv3d(in_channels, out_channels, kernel_size, stride, kernel_size // 2, bias=False)

    def stem(self, in_channels: int, out_channels: int, stem: Stem) -> nn.Sequential:
        """``small``: 3^3 conv stride 1, norm, act. ``standard``: 7^3 conv stride 2, norm, act, 3^3 max-pool stride 2.

        The stem conv is always dense. ``stem`` must be resolved already (:func:`resolve_stem`).
        """
        kernel_size, stride = {Stem.small: (3, 1), Stem.standard: (7, 2)}[stem]
        parts = OrderedDict(
            conv=Conv3d(in_channels, out_channels, kernel_size, stride, kernel_size // 2, bias=False),
            norm=self.norm(out_channels),
            act=self.act(out_channels),
        )
        if stem is Stem.standard:
            parts["pool"] = nn.MaxPool3d(3, 2, 1)
        return nn.Sequential(parts)

    def head(self, channels: int, num_classes: int, preact: bool = False) -> nn.Sequential:
        """Global average pool and a linear classifier; ``preact`` puts a norm and an act first (DenseNet)."""
        parts = OrderedDict(norm=self.norm(channels), act=self.act(channels)) if preact else OrderedDict()
        parts.update(pool=nn.AdaptiveAvgPool3d(1), flatten=nn.Flatten(), fc=nn.Linear(channels, num_classes))
        return nn.Sequential(parts)


def conv_fans(conv: nn.Conv3d) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of a possibly grouped conv: ``(C_in/groups) k^3`` and ``(C_out/groups) k^3``.

    PyTorch's own fan_out ignores groups, which overstates a depthwise conv's fan_out by ``C_out``.
    """
    taps = math.prod(conv.kernel_size)
    return conv.in_channels // conv.groups * taps, conv.out_channels // conv.groups * taps


def init_weights(model: nn.Module, init: Init, mode: InitMode, activation: Activation) -> None:
    """Initialise every conv for ``activation`` and set every norm to weight 1, bias 0.

    Conv std: kaiming ``gain / sqrt(fan)`` (``fan`` chosen by ``mode``; uniform bound ``sqrt(3)`` std),
    xavier ``gain * sqrt(2 / (fan_in + fan_out))`` (``mode`` unused), with :func:`activation_gain` and
    the group-corrected :func:`conv_fans`. The classifier keeps PyTorch's weight init (uniform in
    ``±1/sqrt(fan_in)``, small logits) with a zero bias. ``torch_default`` leaves every conv and the
    classifier as PyTorch made them. The default switches (kaiming_normal, fan_out, relu) reproduce MONAI's
    and torchvision's ResNet init.
    """
    gain = activation_gain(activation)
    for module in model.modules():
        if isinstance(module, NORMS):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif init is Init.torch_default:
            continue
        elif isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Conv3d):
            fan_in, fan_out = conv_fans(module)
            if init is Init.xavier_normal:
                std = gain * math.sqrt(2.0 / (fan_in + fan_out))
            else:
                std = gain / math.sqrt(fan_in if mode is InitMode.fan_in else fan_out)
            if init is Init.kaiming_uniform:
                nn.init.uniform_(module.weight, -math.sqrt(3.0) * std, math.sqrt(3.0) * std)
            else:
                nn.init.normal_(module.weight, 0.0, std)
