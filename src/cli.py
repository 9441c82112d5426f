"""The one command wrapper of ``python -m src.<command>``: Hydra on ``conf/<name>.yaml`` with the typed schema
registered; a failed composition, a key the schema does not declare (even forced with ``+``) and a
:class:`UsageError` are printed as one ``error:`` line with exit code 2, before the command starts."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from src.config import register
from src.errors import UsageError
from src.schema_check import check_known_keys, unknown_key_message

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
FULL_ERROR = "HYDRA_FULL_ERROR"  # "1": Hydra raises its errors instead of printing them and exiting 1


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
                check_known_keys(cfg, HydraConfig.get().overrides.task)
                return fn(cfg)
            except BaseException as err:
                if on_failure is not None:
                    on_failure(cfg, err)
                if isinstance(err, UsageError):
                    print(f"error: {err}", file=sys.stderr)
                    sys.exit(2)
                raise

        return reporting_composition_errors(main)

    return decorate


def reporting_composition_errors(hydra_main: Callable[..., Any]) -> Callable[..., Any]:
    """Hydra prints a failed composition over several lines and exits 1: make it one ``error:`` line, exit 2.
    With ``HYDRA_FULL_ERROR=1`` set by the user, Hydra's own report stands."""

    @functools.wraps(hydra_main)
    def run(*args: Any) -> Any:
        previous = os.environ.get(FULL_ERROR)
        if previous == "1":
            return hydra_main(*args)
        os.environ[FULL_ERROR] = "1"
        try:
            return hydra_main(*args)
        except (ConfigCompositionException, OverrideParseException) as err:
            print(f"error: {composition_error(err, sys.argv[1:])}", file=sys.stderr)
            sys.exit(2)
        finally:
            if previous is None:
                del os.environ[FULL_ERROR]
            else:
                os.environ[FULL_ERROR] = previous

    return run


def composition_error(err: Exception, overrides: Sequence[str]) -> str:
    """Hydra's composition error as one line naming the bad value and the fix."""
    if isinstance(err, MissingConfigException) and err.options and "/" in (err.missing_cfg_file or ""):
        group, _, option = err.missing_cfg_file.rpartition("/")
        return f"{group}={option} is not an option of {group}: use one of {', '.join(err.options)}"
    cause = err.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and dataclasses.is_dataclass(cause.object_type):
        return unknown_key_message(cause.full_key, cause.object_type, overrides)  # an override of no schema key
    texts = [f"cannot parse the override {err.override}"] if isinstance(err, OverrideParseException) else []
    texts += [str(err)] + ([str(cause)] if isinstance(cause, OmegaConfBaseException) else [])
    lines = [line for text in texts for line in text.split("Config search path:")[0].splitlines()]
    return "; ".join(line.strip().rstrip(".") for line in lines if line.strip() and not line[0].isspace())
