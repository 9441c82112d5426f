"""Predict a run's peak training memory (what ``mem/peak_mb`` will read) before training.

    python -m src.memory model=densenet121 batch_size=16 amp=true data=synthetic

Draft: components measured by one forward on fake tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from src.config import Config
from src.engine import resolve_amp_dtype
from src.models import build_model
from src.models.layers import activation_gain

MIB = 2**20


@dataclass(frozen=True)
class SavedBytes:
    activations: int
    amp_copies: int
    params: int
    buffers: int


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return t.untyped_storage()


def saved_bytes(cfg: Config, device: torch.device, batch_size: int) -> SavedBytes:
    activation_gain(cfg.model.activation)  # cached outside fake mode: it reads a value (.item())
    data = cfg.data
    amp_dtype = resolve_amp_dtype(cfg, device)
    with FakeTensorMode():
        with torch.device(device):
            model = build_model(cfg.model, data.in_channels, data.num_classes, data.size).train()
            images = torch.empty(batch_size, data.in_channels, data.size, data.size, data.size)
            labels = torch.zeros(batch_size, dtype=torch.long)
        own = {_storage(t)._cdata for t in [*model.parameters(), *model.buffers(), images]}
        found: dict[int, tuple[str, int]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = _storage(t)
            if storage._cdata not in own:
                node = t.grad_fn
                weight_cast = (type(node).__name__ == "ToCopyBackward0"
                               and type(node.next_functions[0][0]).__name__ == "AccumulateGrad")
                found[storage._cdata] = ("amp" if weight_cast else "act", storage.nbytes(), storage)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast(device.type, dtype=amp_dtype, enabled=cfg.amp):
            F.cross_entropy(model(images), labels)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return SavedBytes(sum(n for kind, n, _ in found.values() if kind == "act"),
                      sum(n for kind, n, _ in found.values() if kind == "amp"), params, buffers)


@dataclass(frozen=True)
class MemoryPrediction:
    params_mb: float
    gradients_mb: float
    optimizer_mb: float
    amp_copies_mb: float
    activations_mb: float
    input_mb: float
    total_mb: float

    def as_dict(self):
        import dataclasses
        return dataclasses.asdict(self)


def predict(cfg: Config, device: torch.device, batch_size: int | None = None) -> MemoryPrediction:
    batch = batch_size or cfg.batch_size
    s = saved_bytes(cfg, device, batch)
    mult = {"sgd": 1 if cfg.optim.momentum else 0, "adam": 2, "adamw": 2}[cfg.optim.name.value]
    voxels = batch * cfg.data.in_channels * cfg.data.size ** 3
    comp = dict(params_mb=s.params / MIB, gradients_mb=s.params / MIB, optimizer_mb=mult * s.params / MIB,
                amp_copies_mb=s.amp_copies / MIB, activations_mb=s.activations / MIB, input_mb=5 * voxels / MIB)
    total = sum(v for k, v in comp.items() if k != "params_mb")
    return MemoryPrediction(**comp, total_mb=total)
