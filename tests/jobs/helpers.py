"""What the job tests share."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from src.tracking.identity import code_fingerprint, config_hash, flatten
from src.tracking.store import experiment_id
from src.training import checkpoint
from tests.helpers import ROOT, compose_config


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


def as_sweep_job(sweep_dir: Path, monkeypatch) -> None:
    """This process as job 0 of a sweep in ``sweep_dir``: Hydra's config as a job of it sees it (the test's own goes
    back with ``monkeypatch``)."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        composed = compose("config", [f"hydra.sweep.dir={sweep_dir}"], return_hydra_config=True)
    with open_dict(composed):
        composed.hydra.job.num = 0
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)
    HydraConfig.instance().set_config(composed)
