"""The one command wrapper of ``python -m src.<command>``: Hydra on ``conf/<name>.yaml`` with the typed schema
registered; a failed composition, a key the schema does not declare (even forced with ``+``), a value outside its
range (the schema's checks) and a :class:`UsageError` are printed as one ``error:`` line with exit code 2, before
the command starts."""

from __future__ import annotations

import functools
import os
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from src.config import register
from src.errors import UsageError, exit_with
from src.folders import release
from src.schema_check import check_known_keys, composition_error

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
FULL_ERROR = "HYDRA_FULL_ERROR"  # "1": Hydra raises its errors instead of printing them and exiting 1


def command(config_name: str, zoo: bool = True) -> Callable[[Callable[[DictConfig], Any]], Callable[[], Any]]:
    """``@command("report", zoo=False)`` makes ``fn(cfg)`` a Hydra app (``zoo``: :func:`src.config.register`'s)."""
    register(zoo)
    warnings.filterwarnings(  # what conf/hydra/launcher/<plugin>.yaml wants: a wrong key in it fails; no 4-line notice
        "ignore", r"\s*'hydra/launcher/[^']+' is validated against ConfigStore schema with the same name", UserWarning
    )

    def decorate(fn: Callable[[DictConfig], Any]) -> Callable[[], Any]:
        @hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")
        @functools.wraps(fn)
        def main(cfg: DictConfig) -> Any:
            try:
                check_known_keys(cfg, HydraConfig.get().overrides.task)
                check_values(cfg)
                return fn(cfg)
            except UsageError as err:
                release(Path(HydraConfig.get().runtime.output_dir))
                exit_with(err)

        return reporting_composition_errors(main)

    return decorate


def check_values(cfg: DictConfig) -> None:
    """The typed schema's checks (types, mandatory values, each ``__post_init__``'s ranges) as one-line
    :class:`UsageError`s."""
    try:
        OmegaConf.to_object(cfg)
    except (ValueError, MissingMandatoryValue) as err:  # OmegaConf's: the key in full_key, then indented detail
        key, line = getattr(err, "full_key", None), str(err).partition("\n")[0]
        raise UsageError(f"{key}: {line}" if key else line) from None


def reporting_composition_errors(hydra_main: Callable[..., Any]) -> Callable[..., Any]:
    """Hydra prints a failed composition over several lines and exits 1: make it one ``error:`` line, exit 2; Ctrl-C
    outside a job one line, exit 130, not a traceback. With ``HYDRA_FULL_ERROR=1`` set by the user, Hydra's own report
    stands."""

    @functools.wraps(hydra_main)
    def run(*args: Any) -> Any:
        previous = os.environ.get(FULL_ERROR)
        if previous == "1":
            return hydra_main(*args)
        os.environ[FULL_ERROR] = "1"
        try:
            sys.argv[1:] = hydra_arguments(sys.argv[1:])
            return hydra_main(*args)
        except (ConfigCompositionException, OverrideParseException) as err:
            exit_with(UsageError(composition_error(err, sys.argv[1:])))
        except UsageError as err:
            exit_with(err)
        except KeyboardInterrupt:  # Ctrl-C outside a job (a job turns it into a checkpoint and exit 130 itself)
            print("stopped (Ctrl-C)", file=sys.stderr)
            sys.exit(128 + signal.SIGINT)
        finally:
            if previous is None:
                del os.environ[FULL_ERROR]
            else:
                os.environ[FULL_ERROR] = previous

    return run


SWITCHES = ("-m", "--multirun", "-r", "--run", "--resolve", "-sc", "--shell-completion")  # Hydra's, without a value
HELP = ("-h", "--help", "--hydra-help", "--version")  # Hydra prints and exits


def hydra_arguments(argv: list[str]) -> list[str]:
    """``argv`` with Hydra's switches placed before the overrides, where its parser wants them (``model=x -m seed=0,1``
    is ``-m model=x seed=0,1``); a :class:`UsageError` naming what Hydra refuses (an unknown flag, a flag without its
    value, two modes), in place of its usage lines or traceback."""
    switches = [i for i, arg in enumerate(argv) if arg in SWITCHES and not (i and takes_value(argv[i - 1]))]
    ordered = [argv[i] for i in switches] + [arg for i, arg in enumerate(argv) if i not in switches]
    parser = get_args_parser()
    parser.error = refuse  # type: ignore[method-assign]  # argparse's own: usage lines, then exit 2
    parsed = parser.parse_args([arg for arg in ordered if arg not in HELP])
    modes = {
        "--run": parsed.run,
        "--multirun": parsed.multirun,
        "--cfg": parsed.cfg,
        "--info": parsed.info,
        "--shell-completion": parsed.shell_completion,
    }
    if len(given := [flag for flag, value in modes.items() if value not in (None, False)]) > 1:
        refuse(f"{' and '.join(given)} together: give one of them")
    if parsed.resolve and parsed.cfg is None and not set(HELP) & set(argv):
        refuse("--resolve works with --cfg or --help only")
    return ordered


def takes_value(arg: str) -> bool:
    """Whether ``arg`` is one of Hydra's flags followed by its value (``--cfg job``, ``-cn name``, ...)."""
    valued = ("-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir")
    return arg in (*valued, "--experimental-rerun", "-i", "--info")


def refuse(message: str) -> NoReturn:
    raise UsageError(f"{message} (the overrides are key=value; --help lists the flags)")
