"""What the training tests share: a small net and a trainer on the shipped AdrenalMNIST3D file, a planted peak cache,
checkpoints compared."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from src.data.loaders import load_splits, make_loader
from src.parallel.dist import Rank
from src.parallel.preemption import Preemption
from src.training import checkpoint
from src.training.faults import fault_hooks
from src.training.meters import peak_key
from src.training.trainer import Hooks, Trainer
from tests.helpers import compose_config, graph_on_cpu, on_cpu

CPU = torch.device("cpu")


def tiny_net(num_classes: int = 2) -> nn.Module:
    """Batch-independent (GroupNorm), so a split batch gives the same gradients as the whole one."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(1, 4, 3, stride=2),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(4, num_classes),
    )


def trainer_for(
    *overrides: str, data_root, model: nn.Module | None = None, width: int = 1, hooks: Hooks | None = None
) -> Trainer:
    """A trainer on the real AdrenalMNIST3D file on the CPU; ``width``: devices sharing one loader batch
    (``parallel=dp``), whose loaders give ``batch_size x width`` samples."""
    cfg = OmegaConf.to_object(
        compose_config("data=adrenalmnist3d", f"data.root={data_root}", "data.download=false", "device=cpu", *overrides)
    )
    cpu = torch.device("cpu")
    loaders = {
        s: make_loader(cfg.data, t, cfg.batch_size * width, cfg.seed, s == "train", cpu)
        for s, t in load_splits(cfg.data).items()
    }
    return Trainer(cfg, model or tiny_net(), loaders, on_cpu(cfg), hooks=hooks)


def plant_peak(folder: Path, flops: float, at: datetime.datetime, threads: int | None = None) -> str:
    """A peak cache in ``folder`` holding ``flops`` for this CPU in float32, probed ``at``; returns its key."""
    key = peak_key(CPU, torch.float32, threads)
    entry = {"flops": flops, "source": "probe", "at": at.isoformat()}
    (folder / "peak_flops.json").write_text(json.dumps({key: entry}))
    return key


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)


NOT_RESULTS = ("perf/", "mem/", "time/")  # measurements of the process, not results


def assert_same_weights(path: Path, reference: Path) -> None:
    ours, theirs = torch.load(path, weights_only=True), torch.load(reference, weights_only=True)
    for part in ("model", "best_state", "ema"):
        if ours[part] is None and theirs[part] is None:
            continue
        assert ours[part].keys() == theirs[part].keys()
        assert all(torch.equal(ours[part][k], theirs[part][k]) for k in ours[part]), part
    assert all(
        torch.equal(a, b)
        for a, b in zip(ours["optimizer"]["state"][0].values(), theirs["optimizer"]["state"][0].values(), strict=True)
    )


def bn_net() -> nn.Module:
    """Small, with BatchNorm running statistics (buffers must come back too)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(1, 4, 3, stride=2),
        nn.BatchNorm3d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    )


def trainer(shared_data, folder: Path, *overrides: str, preemption: Preemption | None = None) -> Trainer:
    """Cyclic LR (stepped per optimizer step) and accumulation: the state a mid-epoch stop must keep. The override
    ``graphed`` steps through the CUDA-graph path with its CPU stand-in (:func:`tests.helpers.graph_on_cpu`)."""
    graphed = "graphed" in overrides
    overrides = tuple(o for o in overrides if o != "graphed")
    cfg = OmegaConf.to_object(
        compose_config(
            "data=adrenalmnist3d",
            f"data.root={shared_data}",
            "data.download=false",
            "device=cpu",
            "batch_size=2",
            "accumulate=2",
            "limit_batches=6",
            "epochs=3",
            "sched=cyclic",
            *overrides,
        )
    )
    cpu = torch.device("cpu")
    loaders = {
        s: make_loader(cfg.data, t, cfg.batch_size, cfg.seed, s == "train", cpu)
        for s, t in load_splits(cfg.data).items()
    }
    folder.mkdir(exist_ok=True)
    hooks = Hooks(
        checkpoint_to=folder / checkpoint.FILE,
        preemption=preemption or Preemption(),
        after_step=fault_hooks(cfg, Rank()),
    )
    made = Trainer(cfg, bn_net(), loaders, on_cpu(cfg), Rank(), hooks)
    return graph_on_cpu(made) if graphed else made
