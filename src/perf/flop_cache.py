"""Training FLOPs per sample (:func:`src.training.mfu.flops_per_sample`) kept in ``flops_per_sample.json`` beside the
peak-FLOP/s cache (:mod:`src.perf.probe_cache`): counting densenet121 at 28^3 on the meta device takes ~4 s of one
core (2026-11-25), a read nothing. Keyed by the model and data configs (where the data lives aside:
:data:`src.tracking.identity.NOT_HASHED`), torch's version and the code's fingerprint."""

from __future__ import annotations

import dataclasses
import datetime

from src.caches import number
from src.config import Config
from src.perf.probe_cache import ProbeCache, age, software_key
from src.tracking.identity import NOT_HASHED
from src.training.mfu import flops_per_sample

MAX_AGE = datetime.timedelta(days=30)
CACHE = ProbeCache(
    "flops_per_sample.json", lambda entry: age(entry) <= MAX_AGE, {"flops_per_sample": number(0, above=True)}
)


def counted_flops(cfg: Config) -> float:
    """``flops_per_sample(cfg)``, from the cache when it holds it."""
    data = {k: v for k, v in dataclasses.asdict(cfg.data).items() if not f"data.{k}".startswith(NOT_HASHED)}
    name = software_key(repr((cfg.model, data)))  # ~0.1 ms; OmegaConf's config_hash ~30 ms
    entry = CACHE.get(name) or CACHE.put(name, {"flops_per_sample": flops_per_sample(cfg)})
    return entry["flops_per_sample"]
