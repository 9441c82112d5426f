"""The one command wrapper of ``python -m src.<command>``: Hydra on ``conf/<name>.yaml`` with the typed schema
registered, and a :class:`UsageError` printed as one ``error:`` line with exit code 2."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Callable

import hydra
from omegaconf import DictConfig

from src.config import register
from src.errors import UsageError

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def command(
    config_name: str, on_failure: Callable[[DictConfig, BaseException], None] | None = None
) -> Callable[[Callable[[DictConfig], Any]], Callable[[], Any]]:
    """``@command("report")`` makes ``fn(cfg)`` a Hydra app; ``on_failure(cfg, error)`` runs on any error first."""
    register()

    def decorate(fn: Callable[[DictConfig], Any]) -> Callable[[], Any]:
        @hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")
        @functools.wraps(fn)
        def main(cfg: DictConfig) -> Any:
            try:
                return fn(cfg)
            except BaseException as err:
                if on_failure is not None:
                    on_failure(cfg, err)
                if isinstance(err, UsageError):
                    print(f"error: {err}", file=sys.stderr)
                    sys.exit(2)
                raise

        return main

    return decorate
