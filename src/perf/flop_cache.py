"""Training FLOPs per sample (:func:`src.training.mfu.flops_per_sample`) kept in ``flops_per_sample.json`` beside the
peak-FLOP/s cache (:mod:`src.perf.probe_cache`): counting densenet121 at 28^3 on the meta device takes ~4 s of one
core (2026-11-25), a read nothing. Keyed by the model and data configs (where the data lives aside:
:func:`src.tracking.identity.config_hash`), torch's version and the code's fingerprint."""

from __future__ import annotations

import datetime

from omegaconf import OmegaConf

from src.config import Config
from src.perf.probe_cache import ProbeCache, age, software_key
from src.tracking.identity import config_hash, flatten
from src.training.mfu import flops_per_sample

MAX_AGE = datetime.timedelta(days=30)
CACHE = ProbeCache("flops_per_sample.json", fresh=lambda entry: age(entry) <= MAX_AGE)


def counted_flops(cfg: Config) -> float:
    """``flops_per_sample(cfg)``, from the cache when it holds it."""
    counted = {k: v for k, v in flatten(OmegaConf.structured(cfg)).items() if k.startswith(("model.", "data."))}
    name = software_key(config_hash(counted))
    entry = CACHE.get(name) or CACHE.put(name, {"flops_per_sample": flops_per_sample(cfg)})
    return entry["flops_per_sample"]
