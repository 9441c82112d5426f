"""python -m src.volumes data=nifti data.root=<folder> [data.size=64 ...]: build the cache a run with the same overrides
would train on (if missing), and describe it: classes, split sizes, spacings seen, the cache file and its size.
Nothing is trained or logged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from src.cli import command
from src.config import NIFTI, SPLITS
from src.data.nifti.cache import ensure, read_meta
from src.errors import UsageError

SHOWN_SPACINGS = 5  # the most common spacings listed; the rest counted


@command("memory")  # the training config, nothing written (no outputs/ folder, no sweep callbacks)
def main(cfg: DictConfig) -> None:
    data = OmegaConf.to_object(cfg).data
    if data.name != NIFTI:
        raise UsageError(f"python -m src.volumes describes a NIfTI folder, not data={data.name}: add data=nifti")
    print(describe(ensure(data)), flush=True)


def mm(spacing: list[float]) -> str:
    return " x ".join(f"{s:g}" for s in spacing)


def describe(path: Path) -> str:
    meta = read_meta(path)
    with np.load(path) as npz:
        labels = {split: npz[f"{split}_labels"].reshape(-1) for split in SPLITS}
    classes, keys = meta["classes"], meta["preprocessing"]
    counts = {split: np.bincount(labels[split], minlength=len(classes)) for split in SPLITS}
    per_class = [
        f"{k} {name}: " + ", ".join(f"{split} {counts[split][k]}" for split in SPLITS) for k, name in enumerate(classes)
    ]
    seen = meta["spacings"]
    shown = [f"{mm(spacing)} ({n} volume{'s' if n > 1 else ''})" for spacing, n in seen[:SHOWN_SPACINGS]]
    more = f", {len(seen) - SHOWN_SPACINGS} more" if len(seen) > SHOWN_SPACINGS else ""
    origin = "the CSV's split column" if meta["split_given"] else "seeded: data.split_fractions, data.split_seed"
    chosen = "data.spacing" if keys["spacing"] else "the training median"
    intensity = keys["intensity"] + (
        f" (level {keys['window_level']:g}, width {keys['window_width']:g})" if keys["intensity"] == "window" else ""
    )
    return "\n".join(
        [
            f"volumes   {meta['root']} (labels {meta['labels']})",
            f"classes   {' | '.join(per_class)}",
            f"splits    {', '.join(f'{split} {len(labels[split])}' for split in SPLITS)} ({origin})",
            f"spacings  seen, mm along R x A x S: {'; '.join(shown)}{more}",
            f"          resampled to {mm(meta['spacing'])} mm ({chosen}), cropped or padded to {keys['size']}^3, "
            f"intensity {intensity}",
            f"cache     {path} ({path.stat().st_size / 2**20:.1f} MiB; digest of the CSV and volumes {meta['digest']})",
        ]
    )


if __name__ == "__main__":
    main()
