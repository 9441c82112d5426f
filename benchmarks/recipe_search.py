"""Accuracy of candidate recipes, chosen by validation AUC: each candidate trains to its end, one row per run.

    python -m benchmarks.recipe_search --data adrenalmnist3d --seeds 0 \
        --candidate "model=resnet18 model.stem=standard aug=standard epochs=40" --candidate "experiment=accuracy_cpu"

For choosing a recipe (``conf/experiment/``) where no MLflow store is at hand (a lent GPU machine): the real
composition and ``Trainer`` as ``python -m src.train`` builds them, no MLflow. Rows sorted by the best epoch's
validation AUC, the only column to choose by; the test columns are the MedMNIST protocol's, for the record.
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from src.cli import register
from src.config import Config
from src.data.shipped import SHIPPED
from src.execution import resolve
from src.parallel.ranks import seed_everything
from src.training.build import build_trainer
from src.training.meters import device_name

CONF = Path(__file__).resolve().parent.parent / "conf"
COLUMNS = ("val/auc", "test/auc", "test/acc", "test/balanced_acc", "test/ece", "best_epoch", "stopped_epoch")


def compose_config(overrides: list[str]) -> Config:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=overrides))


def train(overrides: list[str]) -> dict[str, float]:
    """One run to its end: the best epoch's ``val/auc``, the test metrics of its weights, minutes, samples/s."""
    cfg = compose_config(overrides)
    execution = resolve(cfg)
    seed_everything(cfg, execution.threads)
    trainer = build_trainer(cfg, execution)
    start, epochs = time.perf_counter(), []
    final = trainer.fit(lambda metrics, step: epochs.append(metrics))
    speed = [m["perf/samples_per_s"] for m in epochs if "perf/samples_per_s" in m]
    return {
        **final,
        "val/auc": max(m["val/auc"] for m in epochs),
        "minutes": (time.perf_counter() - start) / 60,
        "samples/s": sum(speed) / max(1, len(speed)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--candidate", action="append", required=True, help="overrides of one recipe, quoted")
    parser.add_argument("--data", nargs="+", default=["adrenalmnist3d"], help="data config names")
    parser.add_argument("--size", type=int, default=28)
    parser.add_argument("--root", default=str(SHIPPED))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--extra", default="", help="overrides added to every candidate (device=cuda num_threads=2)")
    args = parser.parse_args()
    register()
    print(f"# {device_name(torch.device('cuda' if torch.cuda.is_available() else 'cpu'))}, torch {torch.__version__}")
    print("| data | candidate | seed | " + " | ".join(COLUMNS) + " | minutes | samples/s |")
    print("|---" * (len(COLUMNS) + 5) + "|")
    for data in args.data:
        for candidate in args.candidate:
            for seed in args.seeds:
                overrides = [
                    f"data={data}",
                    f"data.root={args.root}",
                    "data.download=false",
                    f"data.size={args.size}",
                    *shlex.split(candidate),
                    *shlex.split(args.extra),
                    f"seed={seed}",
                ]
                result = train(overrides)
                cells = [f"{result[c]:.3f}" if c.startswith(("val", "test")) else f"{result[c]:.0f}" for c in COLUMNS]
                print(
                    f"| {data} {args.size} | `{candidate}` | {seed} | "
                    + " | ".join(cells)
                    + f" | {result['minutes']:.1f} | {result['samples/s']:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
