"""src/models/densenet3d.py: the DenseNets' transitions and memory-efficient (checkpointed) layers."""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils.checkpoint import checkpoint

from src.config import Activation, Stem
from src.models import densenet3d
from src.models.densenet3d import DenseLayer, Transition
from src.models.profile import profile_stages
from tests.models.helpers import meta_input, meta_model, small_model


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
