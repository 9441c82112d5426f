"""src/models/profile.py: parameter counts, forward and training FLOPs, stage profiles."""

from __future__ import annotations

import torch
from torch import nn

from src.models.profile import count_params, forward_flops, profile_stages, train_flops
from tests.models.helpers import meta_input, meta_model


def test_profile_stages_sum_to_the_whole_forward():
    model = meta_model("densenet121", 28).eval()
    stages = profile_stages(model, meta_input(28))
    assert sum(s.flops for s in stages) == forward_flops(model, meta_input(28)) > 0
    assert sum(s.params for s in stages) == count_params(model)


def test_weight_gradient_flops_of_grouped_convs_are_corrected():
    with torch.device("meta"):
        for groups in (1, 4, 16):
            conv = nn.Conv3d(16, 16, 3, padding=1, groups=groups, bias=False)
            x = torch.empty(2, 16, 8, 8, 8, requires_grad=True)
            assert train_flops(conv, x) == 3 * forward_flops(conv, x)  # input grad + weight grad = 2x forward
