"""The model zoo: structure under every switch, real gradients, counts against MONAI, FLOPs, init, checkpointing."""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from src.config import Activation, DataConfig, Init, InitMode, ModelConfig, Norm, Shortcut, Stem
from src.models import MODELS, build_model, densenet3d, model_kwargs, resnet3d
from src.models.densenet3d import DenseLayer, Transition
from src.models.layers import (
    NORMS,
    Conv3d,
    DepthwiseSeparableConv3d,
    activation_gain,
    group_count,
    init_weights,
    resolve_stem,
)
from src.models.profile import autocast_weight_grad, count_params, forward_flops, profile_stages
from src.models.resnet3d import ResidualBlock, ZeroPadShortcut

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
# MONAI 1.x, 1 input channel, 2 classes, standard stem, shortcut B, batch norm
MONAI_PARAMS = {
    "densenet121": 11_244_674,
    "densenet169": 18_546_050,
    "resnet18": 33_161_922,
    "resnet34": 63_471_554,
    "resnet50": 46_163_010,
}
# MONAI's ResNet puts a bias on the shortcut-B conv (bias_downsample=True) although a norm follows it;
# ours has none: the last three stages' shortcut widths (x4 for bottlenecks) are the whole difference.
MONAI_SHORTCUT_BIASES = {
    "densenet121": 0,
    "densenet169": 0,
    "resnet18": 128 + 256 + 512,
    "resnet34": 128 + 256 + 512,
    "resnet50": 256 + 512 + 1024 + 2048,
}
NUM_CLASSES = 3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small tensors on a shared 2-core box: one intra-op thread is several times faster than two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def rotate(options: list, *indices: int):
    return options[sum(indices) % len(options)]


# ---------------------------------------------------------------- registry and build_model


def test_unknown_name_is_a_one_line_value_error():
    with pytest.raises(ValueError, match="resnet9000") as error:
        build_model(ModelConfig(name="resnet9000"), DataConfig(name="synthetic", num_classes=2))
    message = str(error.value)
    assert "\n" not in message and all(name in message for name in MODELS)


# ---------------------------------------------------------------- structure under every switch


@pytest.mark.parametrize("stem", list(Stem), ids=lambda s: s.name)
@pytest.mark.parametrize("activation", list(Activation), ids=lambda a: a.name)
@pytest.mark.parametrize("dsconv", [False, True], ids=["dense", "dsconv"])
@pytest.mark.parametrize("name", NAMES)
def test_structure(name, dsconv, activation, stem):
    """Every act and norm of the chosen type, each module run once, 3^3 block convs split iff dsconv."""
    model = small_model(name, stem=stem, dsconv=dsconv, activation=activation).eval()
    calls = Counter()
    for module in model.modules():
        module.register_forward_hook(lambda module, args, out: calls.update([id(module)]))
    with torch.no_grad():
        out = model(torch.randn(1, 1, 28, 28, 28))
    assert out.shape == (1, NUM_CLASSES)
    assert all(calls[id(module)] == 1 for module in model.modules())

    acts = [m for m in model.modules() if isinstance(m, tuple(ACTIVATION_TYPES.values()))]
    assert acts and all(type(m) is ACTIVATION_TYPES[activation] for m in acts)
    assert all(m.inplace for m in acts if isinstance(m, nn.ReLU))
    assert all(type(m) is nn.BatchNorm3d for m in model.modules() if isinstance(m, NORMS))

    spatial = [m for m in model.modules() if isinstance(m, nn.Conv3d) and max(m.kernel_size) > 1]
    depthwise = [m for m in spatial if m.groups > 1]
    assert all(m.groups == m.in_channels == m.out_channels for m in depthwise)
    assert len(depthwise) == (len(spatial) - 1 if dsconv else 0)  # every spatial conv but the stem's
    assert model.stem.conv.groups == 1 and model.stem.conv.kernel_size == (
        (3,) * 3 if resolve_stem(stem, 28) is Stem.small else (7,) * 3
    )


@pytest.mark.parametrize("name,convs", BLOCK_SPATIAL_CONVS.items())
def test_the_zoo_has_its_papers_block_convs(name, convs):
    spatial = [m for m in meta_model(name).modules() if isinstance(m, nn.Conv3d) and max(m.kernel_size) > 1]
    assert len(spatial) == 1 + convs  # the stem's and the blocks'


@pytest.mark.parametrize("norm", [Norm.group, Norm.instance], ids=lambda n: n.name)
@pytest.mark.parametrize("name", ["resnet50", "densenet121"])
def test_group_and_instance_norm_everywhere(name, norm):
    model = small_model(name, norm=norm, dsconv=True, dsconv_mid_norm=True, stem=Stem.small)
    norms = [m for m in model.modules() if isinstance(m, NORMS)]
    assert norms and all(type(m) is NORM_TYPES[norm] for m in norms)
    assert all(m.affine for m in norms if isinstance(m, nn.InstanceNorm3d))
    assert all(m.num_groups == group_count(m.num_channels) for m in norms if isinstance(m, nn.GroupNorm))
    model(torch.randn(2, 1, 28, 28, 28)).sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_group_count_is_largest_divisor_up_to_32():
    assert [group_count(c) for c in (1, 7, 16, 24, 33, 40, 48, 64, 96, 132)] == [1, 7, 16, 24, 11, 20, 24, 32, 32, 22]


def test_prelu_learns_one_slope_per_channel_at_every_position():
    model = small_model("resnet18", activation=Activation.prelu)
    assert model.stem.act.num_parameters == 2 and model.layer4[0].act.num_parameters == 16
    prelus = [m for m in model.modules() if isinstance(m, nn.PReLU)]
    assert len({id(m.weight) for m in prelus}) == len(prelus)


@pytest.mark.parametrize(
    "size,stem,shapes",
    [
        (64, Stem.standard, [16, 16, 8, 4, 2]),
        (28, Stem.small, [28, 28, 14, 7, 4]),
        (28, Stem.standard, [7, 7, 4, 2, 1]),
    ],
)
def test_resnet_stage_shapes(size, stem, shapes):
    stages = profile_stages(meta_model("resnet18", size, stem=stem).eval(), meta_input(size))
    assert [s.name for s in stages] == ["stem", "layer1", "layer2", "layer3", "layer4", "head"]
    assert [s.shape[2:] for s in stages[:-1]] == [(edge,) * 3 for edge in shapes]
    assert stages[-1].shape == (1, 2)


def test_densenet_transitions_keep_1_voxel_maps():
    """MONAI's DenseNet121 fails here: its last transition pools a 1^3 map."""
    stages = profile_stages(meta_model("densenet121", 28, stem=Stem.standard).eval(), meta_input(28))
    assert {s.name: s.shape for s in stages} == {
        "stem": (1, 64, 7, 7, 7),
        "block1": (1, 256, 7, 7, 7),
        "transition1": (1, 128, 3, 3, 3),
        "block2": (1, 512, 3, 3, 3),
        "transition2": (1, 256, 1, 1, 1),
        "block3": (1, 1024, 1, 1, 1),
        "transition3": (1, 512, 1, 1, 1),
        "block4": (1, 1024, 1, 1, 1),
        "head": (1, 2),
    }


def test_auto_stem_is_small_below_64_and_standard_from_64():
    assert resolve_stem(Stem.auto, 28) is Stem.small and resolve_stem(Stem.auto, 64) is Stem.standard
    assert resolve_stem(Stem.small, 64) is Stem.small and resolve_stem(Stem.standard, 28) is Stem.standard


# ---------------------------------------------------------------- real forward and backward


def _gradient_cases():
    for size in (28, 64):
        for s, stem in enumerate(Stem):
            for dsconv in (False, True):
                for n, name in enumerate(NAMES):
                    marks = [pytest.mark.slow] if (size, stem) == (64, Stem.small) else []
                    yield pytest.param(
                        name,
                        size,
                        stem,
                        dsconv,
                        n + s + dsconv,
                        marks=marks,
                        id=f"{name}-{size}-{stem.name}-{'dsconv' if dsconv else 'dense'}",
                    )


@pytest.mark.parametrize("name,size,stem,dsconv,turn", list(_gradient_cases()))
def test_forward_backward_reaches_every_parameter(name, size, stem, dsconv, turn):
    """Batch 2, reduced width; activation, mid norm and shortcut rotate over the cases."""
    torch.manual_seed(turn)
    model = small_model(
        name,
        size,
        stem=stem,
        dsconv=dsconv,
        activation=rotate(list(Activation), turn),
        dsconv_mid_norm=dsconv and turn % 2 == 0,
        shortcut=rotate(list(Shortcut), turn // 2),
    )
    out = model(torch.randn(2, 1, size, size, size))
    assert out.shape == (2, NUM_CLASSES)
    F.cross_entropy(out, torch.tensor([0, 2])).backward()
    for param_name, param in model.named_parameters():
        assert param.grad is not None and param.grad.isfinite().all(), param_name


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


@pytest.mark.parametrize("dsconv", [False, True], ids=["dense", "dsconv"])
@pytest.mark.parametrize("name", NAMES)
def test_every_conv_of_the_zoo_is_the_autocast_safe_one(name, dsconv):
    convs = [m for m in meta_model(name, dsconv=dsconv).modules() if isinstance(m, nn.Conv3d)]
    assert convs and all(type(m) is Conv3d for m in convs)


@pytest.mark.parametrize(
    "name,switches",
    [
        ("resnet18", {"shortcut": Shortcut.A}),
        ("resnet50", {"dsconv": True, "dsconv_mid_norm": True, "activation": Activation.prelu}),
        ("densenet121", {"dsconv": True, "activation": Activation.swish, "stem": Stem.standard}),
    ],
)
def test_channels_last_matches_contiguous(name, switches):
    """In float64, so any difference is a layout bug rather than summation order."""
    torch.manual_seed(0)
    model = small_model(name, in_channels=2, **switches).double()
    x, target = torch.randn(2, 2, 28, 28, 28, dtype=torch.float64), torch.tensor([1, 2])
    results = []
    for memory_format in (torch.contiguous_format, torch.channels_last_3d):
        model.zero_grad()
        model.to(memory_format=memory_format)
        out = model(x.to(memory_format=memory_format))
        F.cross_entropy(out, target).backward()
        results.append((out, [p.grad.clone() for p in model.parameters()]))
    (expected, expected_grads), (out, grads) = results
    torch.testing.assert_close(out, expected)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad)


# ---------------------------------------------------------------- parameter counts and FLOPs


@pytest.mark.parametrize("name", MONAI_PARAMS)
def test_parameter_counts_match_monai(name):
    params = count_params(meta_model(name, 64, stem=Stem.standard, shortcut=Shortcut.B))
    assert params == MONAI_PARAMS[name] - MONAI_SHORTCUT_BIASES[name]
    assert abs(params - MONAI_PARAMS[name]) <= 1e-3 * MONAI_PARAMS[name]


def test_shortcut_a_has_no_parameters():
    shortcut_b = count_params(meta_model("resnet50", shortcut=Shortcut.B))
    shortcut_a = count_params(meta_model("resnet50", shortcut=Shortcut.A))
    conv_and_norm = [(64, 256), (256, 512), (512, 1024), (1024, 2048)]  # first block of each stage
    assert shortcut_b - shortcut_a == sum(cin * cout + 2 * cout for cin, cout in conv_and_norm)


def test_shortcut_a_subsamples_zero_pads_and_passes_gradient():
    x = torch.randn(2, 3, 5, 5, 5, requires_grad=True)
    out = ZeroPadShortcut(8, 2)(x)
    assert out.shape == (2, 8, 3, 3, 3) and (out[:, 3:] == 0).all()
    torch.testing.assert_close(out[:, :3], x[:, :, ::2, ::2, ::2])
    out.sum().backward()
    assert x.grad.sum() == 2 * 3 * 27


@pytest.mark.parametrize("size,stem", [(28, Stem.small), (64, Stem.standard)], ids=["28-small", "64-standard"])
@pytest.mark.parametrize("mid_norm", [False, True], ids=["plain", "mid-norm"])
@pytest.mark.parametrize("name", ["resnet18", "resnet50", "densenet121"])
def test_dsconv_cuts_each_conv_to_1_over_cout_plus_1_over_k3(name, mid_norm, size, stem):
    """Counted forward FLOPs of depthwise + pointwise over the dense conv's, per replaced conv, exactly."""
    counts = {}
    for dsconv in (False, True):
        model = meta_model(name, size, stem=stem, dsconv=dsconv, dsconv_mid_norm=mid_norm).eval()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(meta_input(size))
        counts[dsconv] = {key: sum(ops.values()) for key, ops in counter.get_flop_counts().items()}
        if dsconv:
            replaced = [(key, m) for key, m in model.named_modules() if isinstance(m, DepthwiseSeparableConv3d)]
    root = type(model).__name__
    assert len(replaced) == BLOCK_SPATIAL_CONVS[name]
    for key, conv in replaced:
        dense = counts[False][f"{root}.{key}"]
        split = counts[True][f"{root}.{key}.depthwise"] + counts[True][f"{root}.{key}.pointwise"]
        k3 = math.prod(conv.depthwise.kernel_size)
        assert dense > 0 and Fraction(split, dense) == Fraction(1, conv.pointwise.out_channels) + Fraction(1, k3), key


def test_profile_stages_sum_to_the_whole_forward():
    model = meta_model("densenet121", 28).eval()
    stages = profile_stages(model, meta_input(28))
    assert sum(s.flops for s in stages) == forward_flops(model, meta_input(28)) > 0
    assert sum(s.params for s in stages) == count_params(model)


# ---------------------------------------------------------------- init


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


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_zero_init_residual_zeroes_each_branch_last_norm(name):
    model = small_model(name, zero_init_residual=True, dsconv=True, dsconv_mid_norm=True)
    blocks = [m for m in model.modules() if isinstance(m, ResidualBlock)]
    assert blocks and all((block.branch[-1].weight == 0).all() for block in blocks)
    last_norms = {id(block.branch[-1]) for block in blocks}
    assert all((m.weight == 1).all() for m in model.modules() if isinstance(m, NORMS) and id(m) not in last_norms)


# ---------------------------------------------------------------- memory-efficient DenseNet


def test_checkpointing_gives_the_same_outputs_gradients_and_running_stats():
    models = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        models.append(small_model("densenet121", checkpointing=checkpointing, dsconv=True, activation=Activation.prelu))
    plain, efficient = models
    bottleneck_calls = Counter()
    for name, module in efficient.named_modules():
        if isinstance(module, (DenseLayer, Transition)):
            norm = module.norm1 if isinstance(module, DenseLayer) else module.norm
            norm.register_forward_hook(lambda m, args, out, name=name: bottleneck_calls.update([name]))
    x = torch.randn(2, 1, 28, 28, 28)
    outputs = []
    for model in models:
        out = model(x)
        out.square().sum().backward()
        outputs.append(out)
    torch.testing.assert_close(outputs[1], outputs[0])
    assert len(bottleneck_calls) == 58 + 3 and set(bottleneck_calls.values()) == {2}  # forward, then recomputed
    for (name, a), b in zip(plain.named_parameters(), efficient.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    for (name, a), b in zip(plain.named_buffers(), efficient.buffers(), strict=True):
        assert torch.equal(a, b), name  # one running-stat update per step, not two


def test_checkpointing_only_in_training_with_grad(monkeypatch):
    used = []
    monkeypatch.setattr(densenet3d, "checkpoint", lambda *args, **kwargs: used.append(1) or checkpoint(*args, **kwargs))
    model = small_model("densenet121", checkpointing=True)
    x = torch.randn(2, 1, 28, 28, 28)
    with torch.no_grad():
        model(x)
    model.eval()(x).sum().backward()
    assert not used
    model.train()(x).sum().backward()
    assert len(used) == 58 + 3  # every dense layer and transition
