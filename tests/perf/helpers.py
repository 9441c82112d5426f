"""What the perf tests share: a typed config composed, the memory predictor's figure on the CPU."""

from __future__ import annotations

from omegaconf import OmegaConf

from src.perf import memory
from tests.helpers import compose_config, on_cpu


def typed(*overrides: str):
    return OmegaConf.to_object(compose_config("data=synthetic", "model=resnet18", "model.stem=standard", *overrides))


def predict(cfg, batch_size: int = 4) -> memory.MemoryPrediction:
    return memory.predict(cfg, on_cpu(cfg), batch_size)
