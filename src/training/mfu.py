"""Model FLOPs utilisation: training FLOPs per sample, counted once on the meta device, against the peak of the
devices in the compute dtype; an ``epoch_metrics`` hook adding ``perf/tflops`` and ``perf/mfu``."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import cachetools
import torch

from src.config import Config
from src.execution import Execution
from src.models import build_model
from src.models.profile import train_flops
from src.training.meters import Peak, peak_flops, raise_peak

log = logging.getLogger(__name__)


@cachetools.cached(cachetools.LRUCache(maxsize=16), key=lambda cfg: repr((cfg.model, cfg.data)))
def flops_per_sample(cfg: Config) -> float:
    """Training FLOPs (forward and backward, recomputation not counted) per sample, counted on the meta device
    (once per process for each model and data: a sweep's later jobs reuse it)."""
    shape = (2, cfg.data.in_channels, *[cfg.data.size] * 3)  # batch 2: BatchNorm trains on 1^3 maps
    with torch.device("meta"):
        model = build_model(dataclasses.replace(cfg.model, checkpointing=False), cfg.data).train()
        return train_flops(model, torch.empty(shape)) / shape[0]


@dataclasses.dataclass
class Mfu:
    """``perf/tflops`` achieved and ``perf/mfu`` against ``devices`` x ``peak`` (per device). An epoch whose rate per
    device exceeds the peak raises it first (:func:`~src.training.meters.raise_peak`: the probe again, or the rate
    itself), so ``perf/mfu`` is never above 1; ``on_new_peak`` then hears of it (the run's tags)."""

    flops_per_sample: float
    peak: Peak
    devices: int
    device: torch.device
    dtype: torch.dtype
    on_new_peak: Callable[[Peak], None] = lambda peak: None

    @classmethod
    def of(cls, cfg: Config, execution: Execution, devices: int, flops: float | None = None) -> Mfu:
        """MFU of ``cfg`` trained on ``devices`` x ``execution``'s device in its compute dtype; ``flops``:
        :func:`flops_per_sample` of ``cfg``, counted here when not given."""
        flops = flops_per_sample(cfg) if flops is None else flops
        device, dtype = execution.device, execution.dtype
        return cls(flops, peak_flops(device, dtype), devices, device, dtype)

    def __call__(self, metrics: dict[str, float]) -> dict[str, float]:
        achieved = self.flops_per_sample * metrics["perf/samples_per_s"]
        per_device = achieved / self.devices
        if per_device > self.peak.flops:
            log.warning(
                "%.4g TFLOP/s per device exceeds the %s peak of %.4g: raising the peak",
                per_device / 1e12,
                self.peak.source,
                self.peak.flops / 1e12,
            )
            self.peak = raise_peak(self.device, self.dtype, per_device)
            self.on_new_peak(self.peak)
        return {"perf/tflops": achieved / 1e12, "perf/mfu": per_device / self.peak.flops}

    def tags(self) -> dict[str, str]:
        """The run's tags for the peak: ``perf.peak_source``, ``perf.peak_tflops_per_device`` and, for a probed or
        measured peak, ``perf.peak_updated_at`` (last probed or raised, ISO 8601 UTC) and ``perf.peak_age_days``."""
        tags = {"perf.peak_source": self.peak.source, "perf.peak_tflops_per_device": f"{self.peak.flops / 1e12:.6g}"}
        if self.peak.at:
            age_days = self.peak.age().total_seconds() / 86400
            tags |= {"perf.peak_updated_at": self.peak.at.isoformat(), "perf.peak_age_days": f"{age_days:.1f}"}
        return tags
