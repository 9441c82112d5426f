"""src/models/layers.py: group counts, the stem, the autocast-safe conv, the initialisations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from src.config import Activation, Init, InitMode, Norm, Stem
from src.models.layers import NORMS, Conv3d, activation_gain, group_count, init_weights, resolve_stem
from src.models.profile import autocast_weight_grad
from tests.models.helpers import small_model


def test_group_count_is_largest_divisor_up_to_32():
    assert [group_count(c) for c in (1, 7, 16, 24, 33, 40, 48, 64, 96, 132)] == [1, 7, 16, 24, 11, 20, 24, 32, 32, 22]


def test_auto_stem_is_small_below_64_and_standard_from_64():
    assert resolve_stem(Stem.auto, 28) is Stem.small and resolve_stem(Stem.auto, 64) is Stem.standard
    assert resolve_stem(Stem.small, 64) is Stem.small and resolve_stem(Stem.standard, 28) is Stem.standard


# (C_in, C_out, kernel, stride, map): shapes where torch 2.13's oneDNN returns a wrong bf16 weight gradient on
# avx512_bf16 CPUs when the conv pads itself (relative error 0.9-1e37, sometimes heap corruption; docs/benchmarks.md)
ONEDNN_BF16_FAULTS = [
    (32, 32, 3, 1, (2, 2, 2)),
    (128, 32, 3, 1, (2, 4, 4)),
    (64, 128, 3, 2, (4, 1, 6)),
    (1, 32, 3, 1, (2, 6, 6)),
]


@pytest.mark.parametrize("in_channels,out_channels,kernel,stride,shape", ONEDNN_BF16_FAULTS)
def test_bf16_weight_gradient_is_right_on_maps_no_larger_than_the_kernel(
    in_channels, out_channels, kernel, stride, shape
):
    torch.manual_seed(0)
    conv = Conv3d(in_channels, out_channels, kernel, stride, kernel // 2, bias=False)
    out, error = autocast_weight_grad(conv, torch.randn(2, in_channels, *shape))
    assert out.dtype == torch.bfloat16 and error < 0.02  # bf16 rounding: 0.3% here; the fault: 0.9 and up


def test_explicit_padding_gives_the_same_conv():
    torch.manual_seed(0)
    conv = Conv3d(8, 16, (3, 1, 5), 2, (1, 0, 2), bias=True).double()
    x = torch.randn(2, 8, 2, 5, 3, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast leaves float64 alone: only the padding differs
        padded = conv(x)
    torch.testing.assert_close(padded, F.conv3d(x, conv.weight, conv.bias, 2, (1, 0, 2)))


def test_gain_is_the_second_moment_rule():
    """Equal to torch's gains for ReLU and PReLU's initial slope; Gauss-Hermite agrees for the smooth ones."""
    assert activation_gain(Activation.relu) == pytest.approx(nn.init.calculate_gain("relu"), rel=1e-9)
    assert activation_gain(Activation.prelu) == pytest.approx(nn.init.calculate_gain("leaky_relu", 0.25), rel=1e-9)
    nodes, weights = np.polynomial.hermite_e.hermegauss(120)
    z = torch.from_numpy(nodes)
    for activation, f in ((Activation.swish, F.silu), (Activation.gelu, F.gelu), (Activation.mish, F.mish)):
        second_moment = float(np.sum(weights * f(z).square().numpy()) / math.sqrt(2 * math.pi))
        assert activation_gain(activation) == pytest.approx(second_moment**-0.5, rel=1e-7)


@pytest.mark.parametrize("activation", [Activation.relu, Activation.prelu], ids=lambda a: a.name)
@pytest.mark.parametrize("mode", list(InitMode), ids=lambda m: m.name)
def test_kaiming_normal_std_with_group_corrected_fans(mode, activation):
    torch.manual_seed(0)
    dense, depthwise = nn.Conv3d(64, 128, 3), nn.Conv3d(2048, 2048, 3, groups=2048)
    init_weights(nn.Sequential(dense, depthwise), Init.kaiming_normal, mode, activation)
    gain = nn.init.calculate_gain(*(("relu",) if activation is Activation.relu else ("leaky_relu", 0.25)))
    fan = 64 * 27 if mode is InitMode.fan_in else 128 * 27
    assert dense.weight.std().item() == pytest.approx(gain / math.sqrt(fan), rel=0.05)
    assert depthwise.weight.std().item() == pytest.approx(gain / math.sqrt(27), rel=0.05)  # fan 1 * 3^3 both ways


def test_kaiming_uniform_and_xavier_normal():
    torch.manual_seed(0)
    conv = nn.Conv3d(64, 128, 3)
    init_weights(conv, Init.kaiming_uniform, InitMode.fan_in, Activation.gelu)
    std = activation_gain(Activation.gelu) / math.sqrt(64 * 27)
    assert conv.weight.abs().max().item() <= math.sqrt(3) * std
    assert conv.weight.std().item() == pytest.approx(std, rel=0.05)
    init_weights(conv, Init.xavier_normal, InitMode.fan_out, Activation.mish)
    std = activation_gain(Activation.mish) * math.sqrt(2 / (64 * 27 + 128 * 27))
    assert conv.weight.std().item() == pytest.approx(std, rel=0.05)


def test_norms_start_at_one_and_zero_and_the_classifier_bias_at_zero():
    model = small_model("densenet121", norm=Norm.group, init=Init.xavier_normal)
    for module in model.modules():
        if isinstance(module, NORMS):
            assert (module.weight == 1).all() and (module.bias == 0).all()
    fc = model.head.fc
    assert (fc.bias == 0).all() and fc.weight.abs().max() <= 1 / math.sqrt(fc.in_features)


def test_torch_default_leaves_pytorch_init():
    torch.manual_seed(0)
    conv = small_model("resnet10", init=Init.torch_default).layer4[0].branch.conv2
    bound = 1 / math.sqrt(16 * 27)  # PyTorch's kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert conv.weight.abs().max() <= bound
    assert conv.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
