"""Entry point: ``python -m src.train [-m] key=value ...`` trains one composed experiment per job.

The config is resolved and validated once, here; library code takes typed values.
"""
from __future__ import annotations

import json
import logging
import os
import random
import sys
from pathlib import Path

import hydra
import mlflow
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src import config as schema
from src.data import load_splits, make_loader
from src.engine import Trainer, resolve_amp_dtype, resolve_device
from src.errors import UsageError
from src.models import MODELS, build_model
from src.tracking import RunLogger, config_hash, ensure_store, environment_tags, flatten, read_parent_id, tracking_uri

log = logging.getLogger(__name__)
schema.register()


def seed_everything(cfg: schema.Config) -> int:
    """Seed Python, NumPy and torch, fix the thread count, and enforce determinism when asked."""
    threads = cfg.num_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = cfg.deterministic
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark and not cfg.deterministic
    return threads


def validate(cfg: DictConfig) -> tuple[schema.Config, torch.device]:
    """Every check that needs no data: raises ``UsageError`` before any work starts."""
    try:
        typed: schema.Config = OmegaConf.to_object(cfg)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if typed.model.name not in MODELS:
        raise UsageError(f"model.name={typed.model.name} is not a registered model: use one of {', '.join(MODELS)}")
    device = resolve_device(typed)
    resolve_amp_dtype(typed, device)
    return typed, device


def check_split_sizes(cfg: schema.Config, splits: dict) -> None:
    need, have = cfg.batch_size * cfg.accumulate, len(splits["train"][1])
    if need > have:
        raise UsageError(f"batch_size x accumulate = {need} exceeds the {have} training samples of "
                         f"{cfg.data.name}: lower batch_size or accumulate")


def run_name(overrides: list[str]) -> str:
    return " ".join(overrides)[:250] or "defaults"


def train(cfg: DictConfig) -> float:
    """Validate, then train and evaluate one job into its own MLflow run; returns the test AUC."""
    typed, device = validate(cfg)
    hydra_cfg = HydraConfig.get()
    uri = tracking_uri(typed)
    client = ensure_store(uri)
    splits = load_splits(typed.data)
    check_split_sizes(typed, splits)
    threads = seed_everything(typed)

    model = build_model(typed.model, typed.data.in_channels, typed.data.num_classes, typed.data.size)
    model = model.to(device, memory_format=torch.channels_last_3d if typed.channels_last else torch.contiguous_format)
    loaders = {split: make_loader(typed.data, tensors, typed.batch_size, typed.seed, split == "train", device)
               for split, tensors in splits.items()}
    trainer = Trainer(typed, model, loaders, device)

    output_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode is RunMode.MULTIRUN
    params = flatten(cfg)
    params["effective_batch_size"] = str(typed.batch_size * typed.accumulate)
    params["num_threads_used"] = str(threads)
    run = RunLogger.start(
        client, typed.mlflow.experiment, run_name(list(hydra_cfg.overrides.task)), params,
        tags={"config_hash": config_hash(params), "overrides": " ".join(hydra_cfg.overrides.task),
              "mem.source": trainer.memory.source, "device": str(device), "output_dir": str(output_dir.resolve()),
              **environment_tags()},
        parent_id=read_parent_id(Path(hydra_cfg.sweep.dir)) if multirun else None)
    log.info("MLflow run %s in %s; output %s", run.run_id, uri, output_dir)
    try:
        final = trainer.fit(run.log_metrics)
        (output_dir / "metrics.json").write_text(json.dumps(final, indent=2))
        run.log_artifacts(output_dir / ".hydra", ".hydra")
        run.log_artifacts(output_dir)  # metrics.json and the job log
    except BaseException:
        run.finish("KILLED" if sys.exc_info()[0] is KeyboardInterrupt else "FAILED")
        raise
    run.finish("FINISHED")
    log.info("test/acc=%.4f test/auc=%.4f in %.1f s", final["test/acc"], final["test/auc"], final["time/total_s"])
    return final["test/auc"]


def fail_parent_run(cfg: DictConfig) -> None:
    """A failed job of a sweep marks the sweep's parent run FAILED (its own run is already closed)."""
    hydra_cfg = HydraConfig.get()
    parent_id = read_parent_id(Path(hydra_cfg.sweep.dir)) if hydra_cfg.mode is RunMode.MULTIRUN else None
    if parent_id:
        mlflow.MlflowClient(tracking_uri(cfg)).set_terminated(parent_id, "FAILED")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        return train(cfg)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        fail_parent_run(cfg)
        sys.exit(2)
    except BaseException:
        fail_parent_run(cfg)
        raise


if __name__ == "__main__":
    main()
