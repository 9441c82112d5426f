"""An exponential moving average of a model's weights and buffers, updated with no host-device sync."""

from __future__ import annotations

import copy
from itertools import chain, compress

import torch
from torch import nn

UPDATES = "ema.updates"  # the update count's key in the state dict


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach() for t in chain(model.parameters(), model.buffers())]


class WeightEMA:
    """``decay x average + (1 - decay) x weights`` at each :meth:`update`, from the first update's weights; float
    buffers (BatchNorm statistics) are averaged, integer ones copied. torch's ``AveragedModel`` does the same but
    copies its step counter to the device at every update, a blocking copy on CUDA; the counter here is a Python int."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.module = copy.deepcopy(model).requires_grad_(False)
        self.decay, self.updates = decay, 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Blend ``model`` in (copy it at the first update): device work only, so a CUDA graph can replay it; the
        caller counts the update with :meth:`count` after it ran."""
        mine, theirs = _tensors(self.module), _tensors(model)
        averaged = [bool(self.updates) and t.is_floating_point() for t in mine]
        copied = [not a for a in averaged]
        if any(averaged):
            torch._foreach_lerp_(list(compress(mine, averaged)), list(compress(theirs, averaged)), 1 - self.decay)
        if any(copied):
            torch._foreach_copy_(list(compress(mine, copied)), list(compress(theirs, copied)))

    def count(self) -> None:
        self.updates += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged module's state and the update count, as tensors (``weights_only`` safe)."""
        return {**self.module.state_dict(), UPDATES: torch.tensor(self.updates)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        module = dict(state)
        self.updates = int(module.pop(UPDATES))
        self.module.load_state_dict(module)
