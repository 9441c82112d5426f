"""Predicted vs measured peak training memory on CPU: one fresh process per cell, a Markdown table out.

    python -m benchmarks.memory_table --threads 2 --steps 3   # from the project root

Each cell builds the model, loaders and ``Trainer`` as ``src.train.run_rank`` does (real AdrenalMNIST3D,
``data.loader=tensor``), calls :func:`src.memory.predict` where ``run_rank`` would, starts the memory
monitor as ``Trainer.fit`` does and trains ``--steps`` optimizer steps with ``train_epoch``. A cell runs in
its own interpreter so no RSS peak leaks from one cell into the next. ``--cell KEY=VALUE ...`` runs one cell
here and prints its result as one JSON line (the tests use it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA_ROOT = ROOT.parent / "shared" / "data" / "medmnist"
# (model, data.size, model.stem): densenet121's small stem costs ~50 forward GFLOPs per sample at 28^3,
# too slow for 2 CPU cores, so every cell uses the standard stem.
MODELS = (("resnet18", 28, "standard"), ("resnet18", 64, "standard"), ("densenet121", 64, "standard"))
BATCHES = (4, 16)


def cell_overrides(model: str, size: int, stem: str, batch: int, amp: bool, ckpt: bool) -> list[str]:
    return [f"model={model}", f"data.size={size}", f"model.stem={stem}", f"batch_size={batch}",
            f"amp={str(amp).lower()}", f"model.checkpointing={str(ckpt).lower()}"]


def grid() -> list[list[str]]:
    """Every model x batch x amp, checkpointing on and off for DenseNet only (ResNet ignores it)."""
    return [cell_overrides(model, size, stem, batch, amp, ckpt)
            for model, size, stem in MODELS for batch in BATCHES for amp in (False, True)
            for ckpt in ((False, True) if model.startswith("densenet") else (False,))]


def run_cell(overrides: list[str]) -> dict:
    """Train a few steps in this process as ``run_rank`` and ``fit`` do; the prediction and the measured peak."""
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from src import config as schema
    from src import memory
    from src.data import load_splits, make_loader
    from src.engine import Trainer
    from src.models import build_model
    from src.train import seed_everything, wrap
    from src.dist import Rank

    schema.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=overrides))
    device = torch.device("cpu")
    seed_everything(cfg)
    splits = load_splits(cfg.data)
    model = build_model(cfg.model, cfg.data.in_channels, cfg.data.num_classes, cfg.data.size)
    memory_format = torch.channels_last_3d if cfg.channels_last else torch.contiguous_format
    model = wrap(model.to(device, memory_format=memory_format), cfg, device, Rank(), ())
    loaders = {split: make_loader(cfg.data, tensors, cfg.batch_size, cfg.seed, split == "train", device)
               for split, tensors in splits.items()}
    trainer = Trainer(cfg, model, loaders, device)
    prediction = memory.predict(cfg, device)
    trainer.memory.start()
    trainer.train_epoch(0)
    return {"prediction": dataclasses.asdict(prediction), "measured_mb": trainer.memory.peak()["mem/peak_mb"]}


def child(overrides: list[str]) -> dict:
    result = subprocess.run([sys.executable, "-m", "benchmarks.memory_table", "--cell", *overrides], cwd=ROOT, capture_output=True,
                            text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default=str(DATA_ROOT))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per cell (limit_batches)")
    parser.add_argument("--cell", nargs=argparse.REMAINDER, help="run one cell with these overrides, print JSON")
    args = parser.parse_args()
    fixed = ["data=adrenalmnist3d", f"data.root={args.data_root}", "data.download=false", "device=cpu",
             f"num_threads={args.threads}", f"limit_batches={args.steps}", "epochs=1"]
    if args.cell is not None:
        print(json.dumps(run_cell(fixed + args.cell)))
        return
    print("| model | size | stem | batch | amp | ckpt | predicted MiB | activations MiB | measured MiB | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for overrides in grid():
        values = dict(item.split("=", 1) for item in overrides)
        result = child(fixed + overrides)
        predicted, measured = result["prediction"]["total_mb"], result["measured_mb"]
        print(f"| {values['model']} | {values['data.size']}^3 | {values['model.stem']} | {values['batch_size']} "
              f"| {values['amp']} | {values['model.checkpointing']} | {predicted:.0f} "
              f"| {result['prediction']['activations_mb']:.0f} | {measured:.0f} | {measured / predicted:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
