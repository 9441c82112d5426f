"""Model FLOPs utilisation: training FLOPs per sample, counted once on the meta device, against the peak of the
devices in the compute dtype; an ``epoch_metrics`` hook adding ``perf/tflops`` and ``perf/mfu``."""

from __future__ import annotations

import dataclasses

import cachetools
import torch

from src.config import Config
from src.models import build_model
from src.models.profile import train_flops
from src.resolve import resolve_amp_dtype
from src.training.meters import peak_flops


@cachetools.cached(cachetools.LRUCache(maxsize=16), key=lambda cfg: repr((cfg.model, cfg.data)))
def flops_per_sample(cfg: Config) -> float:
    """Training FLOPs (forward and backward, recomputation not counted) per sample, counted on the meta device
    (once per process for each model and data: a sweep's later jobs reuse it)."""
    shape = (2, cfg.data.in_channels, *[cfg.data.size] * 3)  # batch 2: BatchNorm trains on 1^3 maps
    with torch.device("meta"):
        model = build_model(dataclasses.replace(cfg.model, checkpointing=False), cfg.data).train()
        return train_flops(model, torch.empty(shape)) / shape[0]


@dataclasses.dataclass(frozen=True)
class Mfu:
    """``perf/tflops`` achieved and ``perf/mfu`` against ``devices`` x ``peak_per_device``."""

    flops_per_sample: float
    peak_per_device: float
    peak_source: str  # "table:<gpu>" (a listed GPU) or "probe" (a timed matmul, cached)
    devices: int

    @classmethod
    def of(cls, cfg: Config, device: torch.device, devices: int) -> "Mfu":
        dtype = resolve_amp_dtype(cfg, device) if cfg.amp else torch.float32
        peak, source = peak_flops(device, dtype)
        return cls(flops_per_sample(cfg), peak, source, devices)

    def __call__(self, metrics: dict[str, float]) -> dict[str, float]:
        achieved = self.flops_per_sample * metrics["perf/samples_per_s"]
        return {"perf/tflops": achieved / 1e12, "perf/mfu": achieved / (self.peak_per_device * self.devices)}
