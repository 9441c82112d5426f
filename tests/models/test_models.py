"""src/models/__init__.py: ``build_model`` over the whole zoo: structure under every switch, real gradients, counts
against MONAI, dsconv's FLOPs, cubes of other sizes than 28 and 64 (data=nifti)."""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from src.config import Activation, DataConfig, ModelConfig, Norm, Shortcut, Stem
from src.models import MODELS, build_model
from src.models.layers import NORMS, Conv3d, DepthwiseSeparableConv3d, group_count, resolve_stem
from src.models.profile import count_params
from tests.data.nifti.folders import nifti
from tests.models.helpers import (
    ACTIVATION_TYPES,
    BLOCK_SPATIAL_CONVS,
    NAMES,
    NORM_TYPES,
    NUM_CLASSES,
    meta_input,
    meta_model,
    small_model,
)

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


def rotate(options: list, *indices: int):
    return options[sum(indices) % len(options)]


# ---------------------------------------------------------------- build_model


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


def test_prelu_learns_one_slope_per_channel_at_every_position():
    model = small_model("resnet18", activation=Activation.prelu)
    assert model.stem.act.num_parameters == 2 and model.layer4[0].act.num_parameters == 16
    prelus = [m for m in model.modules() if isinstance(m, nn.PReLU)]
    assert len({id(m.weight) for m in prelus}) == len(prelus)


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


# ---------------------------------------------------------------- parameter counts against MONAI, dsconv's FLOPs


@pytest.mark.parametrize("name", MONAI_PARAMS)
def test_parameter_counts_match_monai(name):
    params = count_params(meta_model(name, 64, stem=Stem.standard, shortcut=Shortcut.B))
    assert params == MONAI_PARAMS[name] - MONAI_SHORTCUT_BIASES[name]
    assert abs(params - MONAI_PARAMS[name]) <= 1e-3 * MONAI_PARAMS[name]


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


# ---------------------------------------------------------------- other cube sizes


@pytest.mark.parametrize(
    "names,size,stem",
    [
        (list(MODELS), 16, Stem.standard),  # the smallest cube through the standard stem (4x) and every stage
        (["resnet10", "densenet121"], 37, Stem.small),  # an odd side
        (["resnet10", "densenet121"], 256, Stem.standard),  # the largest
    ],
    ids=["all-16", "odd-37", "largest-256"],
)
def test_models_map_other_cube_sizes_to_their_classes(names, size, stem):
    """Shapes on the meta device (a family's depth does not change its downsampling)."""
    data = nifti(Path("/x"), f"data.size={size}")
    for name in names:
        with torch.device("meta"):
            out = build_model(ModelConfig(name=name, stem=stem), data)(torch.empty(2, 1, size, size, size))
        assert out.shape == (2, 2), name
