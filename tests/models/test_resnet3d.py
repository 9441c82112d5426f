"""src/models/resnet3d.py: the ResNets' stage shapes, shortcut A, zero-initialised residual branches."""

from __future__ import annotations

import pytest
import torch

from src.config import Shortcut, Stem
from src.models.layers import NORMS
from src.models.profile import count_params, profile_stages
from src.models.resnet3d import ResidualBlock, ZeroPadShortcut
from tests.models.helpers import meta_input, meta_model, small_model


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


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_zero_init_residual_zeroes_each_branch_last_norm(name):
    model = small_model(name, zero_init_residual=True, dsconv=True, dsconv_mid_norm=True)
    blocks = [m for m in model.modules() if isinstance(m, ResidualBlock)]
    assert blocks and all((block.branch[-1].weight == 0).all() for block in blocks)
    last_norms = {id(block.branch[-1]) for block in blocks}
    assert all((m.weight == 1).all() for m in model.modules() if isinstance(m, NORMS) and id(m) not in last_norms)
