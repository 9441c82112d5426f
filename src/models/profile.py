"""Parameter and forward-FLOP counts of zoo models, whole and per stage (for summaries and MFU).

FLOPs are ``torch.utils.flop_counter``'s: 2 per multiply-accumulate of convs and matmuls; norms,
activations, pools and sums count 0. Forward counts are exact for grouped and depthwise convs too, but
the counter's *weight-gradient* count for a grouped conv ignores ``groups`` (it overstates a depthwise
conv's by ``C``): :func:`train_flops` counts backward with that term divided by ``groups``.
Models built under ``torch.device("meta")`` are counted without allocating or computing anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, conv_backward_flop

aten = torch.ops.aten


@dataclass(frozen=True)
class StageProfile:
    """One top-level stage: its name, output shape, trainable parameters and forward FLOPs."""

    name: str
    shape: tuple[int, ...]
    params: int
    flops: int


def count_params(module: nn.Module) -> int:
    """Trainable parameters of ``module``."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def forward_flops(module: nn.Module, x: torch.Tensor) -> int:
    """Forward FLOPs of ``module(x)`` (the whole batch; run in no-grad, mode as the module is)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        module(x)
    return counter.get_total_flops()


def profile_stages(model: nn.Sequential, x: torch.Tensor) -> list[StageProfile]:
    """Feed ``x`` through each stage of a zoo model (an ``nn.Sequential`` of named stages) in turn."""
    rows = []
    with torch.no_grad():
        for name, stage in model.named_children():
            with FlopCounterMode(display=False) as counter:
                x = stage(x)
            rows.append(StageProfile(name, tuple(x.shape), count_params(stage), counter.get_total_flops()))
    return rows


def _grouped_conv_backward_flop(
    grad_out_shape,
    x_shape,
    w_shape,
    bias,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    output_mask,
    out_shape,
    **kwargs,
) -> int:
    """torch's conv backward count with the weight-gradient term divided by ``groups`` (torch omits it)."""
    args = (grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed, output_padding, groups)
    grad_input = conv_backward_flop(*args, [output_mask[0], False, False], out_val=out_shape)
    grad_weight = conv_backward_flop(*args, [False, output_mask[1], False], out_val=out_shape)
    return grad_input + grad_weight // groups


def train_flops(module: nn.Module, x: torch.Tensor) -> int:
    """FLOPs of one training step's forward and backward on ``x`` (the module in train mode)."""
    with FlopCounterMode(
        display=False, custom_mapping={aten.convolution_backward: _grouped_conv_backward_flop}
    ) as counter:
        module(x).float().sum().backward()
    return counter.get_total_flops()


def autocast_weight_grad(conv: nn.Conv3d, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The conv's output under ``torch.autocast("cpu", bfloat16)`` and its weight gradient's ``|g - g64| / |g64|``
    against the float64 reference, for a random output gradient."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv(x)
    grad = torch.randn(out.shape)
    out.float().backward(grad)
    reference = torch.nn.grad.conv3d_weight(x.double(), conv.weight.shape, grad.double(), conv.stride, conv.padding)
    return out, ((conv.weight.grad.double() - reference).norm() / reference.norm()).item()
