"""What the job tests share."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from src.tracking.identity import code_fingerprint, config_hash, flatten
from src.tracking.store import experiment_id
from src.training import checkpoint
from tests.helpers import compose_config


def unfinished_run(client, overrides: list[str], folder: Path, ending: str, weights=None, **tags: str) -> str:
    """A run of the config of ``overrides`` ended ``ending``, whose folder holds its checkpoint (metadata, and
    ``weights`` where given)."""
    cfg = compose_config(*overrides)
    tags = {"config_hash": config_hash(flatten(cfg)), "code_fingerprint": code_fingerprint(), **tags}
    run_id = client.create_run(experiment_id(client, "medsweep"), tags={"output_dir": str(folder), **tags}).info.run_id
    client.set_terminated(run_id, ending)
    stored = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    state = {"run_id": run_id, "epoch": 1, "step": 2, "batch_size": 4, "accumulate": 1, "world": 1, "config": stored}
    checkpoint.save({**state, **({"weights": weights} if weights is not None else {})}, folder / checkpoint.FILE)
    return run_id
