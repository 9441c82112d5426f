"""Print a model's parameters, forward GFLOPs per sample and per-stage shapes, without training.

    python -m src.summary model=densenet121 model.stem=standard data.size=64
    python -m src.summary model=resnet18 model.dsconv=true
    python -m src.summary -m model=resnet18,densenet121

Models are built on the meta device (no memory, no compute), so even densenet264 at 64^3 prints in seconds.
"""

from __future__ import annotations

import dataclasses

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.cli import command
from src.config import Config, DataConfig, ModelConfig
from src.models import build_model
from src.models.profile import StageProfile, count_params, profile_stages


def _shape(shape: tuple[int, ...]) -> str:
    return f"({','.join(map(str, shape))})"


def _meta_profile(cfg: ModelConfig, data: DataConfig) -> tuple[nn.Module, list[StageProfile]]:
    with torch.device("meta"):
        model = build_model(cfg, data).eval()
    return model, profile_stages(model, torch.empty(1, data.in_channels, *[data.size] * 3, device="meta"))


def summarize(cfg: ModelConfig, data: DataConfig) -> str:
    """The ``model=... size=... params=... gflops=... out=...`` line, a stage table and, with dsconv, the FLOP ratio."""
    model, stages = _meta_profile(cfg, data)
    flops = sum(stage.flops for stage in stages)
    lines = [
        f"model={cfg.name} size={data.size} params={count_params(model)} gflops={flops / 1e9:.3f} "
        f"out={_shape(stages[-1].shape)}",
        f"  {'stage':<12} {'output':<22} {'params':>12} {'gflops':>9}",
    ]
    lines += [f"  {s.name:<12} {_shape(s.shape):<22} {s.params:>12,} {s.flops / 1e9:>9.3f}" for s in stages]
    if cfg.dsconv:
        _, dense = _meta_profile(dataclasses.replace(cfg, dsconv=False), data)
        lines.append(f"dsconv flop ratio vs dense: {flops / sum(stage.flops for stage in dense):.3f}")
    return "\n".join(lines)


@command("summary")
def main(dict_cfg: DictConfig) -> None:
    cfg: Config = OmegaConf.to_object(dict_cfg)
    print(summarize(cfg.model, cfg.data), flush=True)


if __name__ == "__main__":
    main()
