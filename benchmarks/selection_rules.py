"""Which epoch's weights to test, judged on validation only: every epoch's validation predictions are recorded, then
each selection rule picks an epoch on one half of the validation split and is scored on the other half.

    python -m benchmarks.selection_rules record --data adrenalmnist3d vesselmnist3d --seeds 3 4 5 --out sel/
    python -m benchmarks.selection_rules score --out sel/

``record`` trains ``experiment=accuracy_cpu`` (or ``--overrides``) as ``python -m src.train`` builds it, no MLflow,
keeping an exponential moving average of the weights beside the trained ones (``ema_decay``, which changes nothing
of the training), and writes ``<data>_<seed>.npz``: per epoch the validation scores of both. A file that
exists is not trained again. ``score`` prints one table row per dataset and rule: the other half's AUC and ACC (the
MedMNIST protocol's) at the picked epoch, mean and std over seeds and random stratified halves.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.recipe_search import compose_config
from src.cli import register
from src.data.shipped import SHIPPED
from src.execution import resolve
from src.parallel.ranks import seed_everything
from src.training.build import build_trainer
from src.training.meters import device_name
from src.training.metrics import medmnist_metrics

SPLITS = 200  # random halves of the validation split per run
SMOOTHING = 0.9  # nnU-Net's moving average of the validation score: 0.9 x previous + 0.1 x this epoch's


def record(data: str, seed: int, overrides: list[str], root: str, out: Path) -> None:
    path = out / f"{data}_{seed}.npz"
    if path.exists():
        return
    cfg = compose_config([f"data={data}", f"data.root={root}", "data.download=false", *overrides, f"seed={seed}"])
    execution = resolve(cfg)
    seed_everything(cfg, execution.threads)
    trainer = build_trainer(cfg, execution)
    kept: dict[str, list] = {"raw_scores": [], "ema_scores": []}
    for epoch in range(cfg.epochs):
        trainer.epoch = epoch
        trainer.train_epoch(epoch)
        for name, module in (("raw", trainer.raw_model), ("ema", trainer.ema.module)):
            trainer.evaluated = module
            _, labels, scores = trainer.predict("val")
            kept[f"{name}_scores"].append(scores)
        print(f"{data} seed {seed} epoch {epoch + 1}/{cfg.epochs}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(path, labels=labels, task=cfg.data.task, **{k: np.asarray(v) for k, v in kept.items()})


def half_metrics(labels: np.ndarray, scores: np.ndarray, task: str) -> tuple[np.ndarray, np.ndarray]:
    """AUC and ACC of every epoch on one half: arrays over epochs."""
    rows = [medmnist_metrics(labels, epoch_scores, task) for epoch_scores in scores]
    return np.array([r["auc"] for r in rows]), np.array([r["acc"] for r in rows])


def log_loss(labels: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Mean cross-entropy of every epoch's scores on ``labels``."""
    picked = np.take_along_axis(scores, labels[None, :, None], axis=2)[..., 0]
    return -np.log(np.clip(picked, 1e-12, None)).mean(axis=1)


def smoothed(values: np.ndarray) -> np.ndarray:
    out = values.copy()
    for i in range(1, len(values)):
        out[i] = SMOOTHING * out[i - 1] + (1 - SMOOTHING) * values[i]
    return out


RULES: dict[str, tuple[str, Callable[[np.ndarray, np.ndarray], int]]] = {  # name: (weights, pick(auc, loss))
    "best val AUC (the protocol)": ("raw", lambda auc, loss: int(np.argmax(auc))),
    "best moving average of val AUC": ("raw", lambda auc, loss: int(np.argmax(smoothed(auc)))),
    "least val loss": ("raw", lambda auc, loss: int(np.argmin(loss))),
    "last epoch": ("raw", lambda auc, loss: len(auc) - 1),
    "EMA weights, best val AUC": ("ema", lambda auc, loss: int(np.argmax(auc))),
    "EMA weights, least val loss": ("ema", lambda auc, loss: int(np.argmin(loss))),
}


def halves(labels: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random half of each class's samples, and the rest."""
    first = np.concatenate(
        [rng.permutation(np.flatnonzero(labels == c))[: (labels == c).sum() // 2] for c in set(labels)]
    )
    mask = np.zeros(len(labels), bool)
    mask[first] = True
    return mask, ~mask


def score(out: Path) -> None:
    print("| data | rule | runs | other half's AUC | other half's ACC | picked epoch |")
    print("|---|---|---|---|---|---|")
    for data in sorted({p.stem.rsplit("_", 1)[0] for p in out.glob("*.npz")}):
        results = {rule: [] for rule in RULES}
        runs = sorted(out.glob(f"{data}_*.npz"))
        for path in runs:
            run = np.load(path)
            labels, task = run["labels"], str(run["task"])
            rng = np.random.default_rng(0)
            for _ in range(SPLITS):
                pick, judge = halves(labels, rng)
                for rule, (weights, choose) in RULES.items():
                    scores = run[f"{weights}_scores"]
                    auc, _ = half_metrics(labels[pick], scores[:, pick], task)
                    epoch = choose(auc, log_loss(labels[pick], scores[:, pick]))
                    other = medmnist_metrics(labels[judge], scores[epoch][judge], task)
                    results[rule].append((other["auc"], other["acc"], epoch + 1))
        for rule, rows in results.items():
            auc, acc, epoch = np.array(rows).T
            print(
                f"| {data} | {rule} | {len(runs)} | {auc.mean():.3f} ± {auc.std():.3f} | {acc.mean():.3f} ± "
                f"{acc.std():.3f} | {np.median(epoch):.0f} ({epoch.min():.0f}-{epoch.max():.0f}) |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=["record", "score"])
    parser.add_argument("--out", type=Path, required=True, help="folder of the recorded runs")
    parser.add_argument("--data", nargs="+", default=["adrenalmnist3d", "vesselmnist3d"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[3, 4, 5], help="not 0-2: the study's own seeds")
    parser.add_argument("--overrides", default="experiment=accuracy_cpu ema_decay=0.99")
    parser.add_argument("--root", default=str(SHIPPED))
    args = parser.parse_args()
    register()
    if args.step == "score":
        score(args.out)
        return
    print(f"# {device_name(torch.device('cpu'))}, torch {torch.__version__}", flush=True)
    for data in args.data:
        for seed in args.seeds:
            record(data, seed, shlex.split(args.overrides), args.root, args.out)


if __name__ == "__main__":
    main()
