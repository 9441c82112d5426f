"""Write the docs' generated parts anew from the code: every key of the schema with its default, range and help
(docs/configuration.md, from :mod:`src.config`), the models of the zoo (from :data:`src.models.registry.MODELS`)
and each preset's sweep and job count (from ``conf/preset/``, the zoo's models included)::

    python -m src.reference           # write the pages whose generated blocks differ
    python -m src.reference --check   # list them, exit 1; write nothing

A generated block lies between two marker comments (:func:`src.config.reference.begin`, ``end``); everything
else on a page is prose, left as it is. ``tests/test_reference.py`` fails where a page differs from what this
writes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from src.cli import CONF_DIR, register
from src.config import Config, ReportConfig
from src.config.bounded import load_yaml
from src.config.reference import blocks_in, key_table, value_text, with_blocks

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/configuration.md", "docs/sweeps.md")  # the pages that hold generated blocks


def models() -> str:
    """The zoo's models, in the registry's order, the default model marked."""
    from src.models import MODELS  # the zoo: importing it registers every model

    default = load_yaml(Path(CONF_DIR) / "config.yaml").defaults
    chosen = next(entry["model"] for entry in default if isinstance(entry, DictConfig) and "model" in entry)
    names = [f"`{name}`{' (default)' if name == chosen else ''}" for name in MODELS]
    return f"{len(MODELS)} registered (`src/models/registry.py`): {' '.join(names)}"


def presets() -> str:
    """A table of the presets of ``conf/preset/``: what each sweeps, the keys it sets, its jobs."""
    lines = ["| preset | sweeps | sets | jobs |", "|---|---|---|---|"]
    for path in sorted(Path(CONF_DIR, "preset").glob("*.yaml")):
        sweeper = preset_sweeper(path.stem)
        params = OmegaConf.to_container(sweeper.params, resolve=True)
        swept = " x ".join(f"`{key}={value}`" for key, value in params.items())
        own = OmegaConf.to_container(load_yaml(path))
        own.pop("defaults", None), own.pop("hydra", None)
        sets = " ".join(f"`{key}={value_text(value)}`" for key, value in dotted(own).items())
        if sweeper._target_.endswith(".BasicSweeper"):
            jobs = str(grid_jobs(params))
        else:  # a sweeper that picks each trial from the results before it (Optuna)
            swept, jobs = f"Optuna trials over {swept}", f"{sweeper.n_trials} trials"
        lines.append(f"| `{path.stem}` | {swept} | {sets} | {jobs} |")
    return "\n".join(lines)


def preset_sweeper(name: str) -> DictConfig:
    """``hydra.sweeper`` as ``python -m src.train -m preset=<name>`` composes it."""
    with initialize_config_dir(CONF_DIR, version_base="1.3"):
        return compose("config", overrides=[f"preset={name}"], return_hydra_config=True).hydra.sweeper


def grid_jobs(params: dict) -> int:
    """The jobs Hydra's basic sweeper makes of ``params``."""
    overrides = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()])
    (batch,) = BasicSweeper.split_arguments(overrides, max_batch_size=None)
    return len(batch)


def dotted(node: dict, prefix: str = "") -> dict:
    """``{"mlflow": {"log_model": True}}`` as ``{"mlflow.log_model": True}``."""
    flat = {}
    for key, value in node.items():
        flat |= dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return flat


BLOCKS: dict[str, Callable[[], str]] = {
    "keys": lambda: key_table(Config),
    "report-keys": lambda: key_table(ReportConfig),
    "models": models,
    "presets": presets,
}


def generated(root: Path | None = None) -> dict[Path, str]:
    """Each page of :data:`PAGES` under ``root`` (the checkout's) as it should read: its generated blocks written
    anew."""
    register()
    pages = {path: path.read_text() for path in (Path(root or ROOT) / page for page in PAGES)}
    names = {name for text in pages.values() for name in blocks_in(text)}
    contents = {name: BLOCKS[name]() for name in names}
    return {path: with_blocks(text, contents) for path, text in pages.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.reference", description=__doc__.partition("::")[0])
    parser.add_argument("--check", action="store_true", help="list the pages that differ, exit 1; write nothing")
    args = parser.parse_args(argv)
    stale = {path: text for path, text in generated().items() if path.read_text() != text}
    for path, text in stale.items():
        if not args.check:
            path.write_text(text)
        print(f"{'differs' if args.check else 'written'}: {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
