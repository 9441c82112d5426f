"""The one command wrapper of ``python -m src.<command>``: Hydra on ``conf/<name>.yaml`` with the typed schema
registered; a failed composition, a key the schema does not declare (even forced with ``+``), a value outside its
range (the schema's checks) and a :class:`UsageError` are printed as one ``error:`` line with exit code 2, before
the command starts."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import hydra
import yaml
from hydra._internal.utils import get_args_parser
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, RangeSweep
from hydra.errors import ConfigCompositionException, HydraException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from src.atomic import uninterrupted_now, when_uninterrupted
from src.config import Config, store_schema
from src.config.bounded import load_yaml
from src.errors import Stopped, UsageError, exit_with, interruption, one_line
from src.folders import register_fresh, release_claimed, release_refused
from src.parallel.preemption import HANGUP
from src.redaction import conceal_arguments
from src.schema_check import (
    check_known_keys,
    check_values,
    composition_error,
    list_index_error,
    unreadable_override,
)

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
FULL_ERROR = "HYDRA_FULL_ERROR"  # "1": Hydra raises its errors instead of printing them and exiting 1


def command(
    config_name: str, zoo: bool = True, sweeps: bool = True
) -> Callable[[Callable[[DictConfig], Any]], Callable[[], Any]]:
    """``@command("report", zoo=False)`` makes ``fn(cfg)`` a Hydra app (``zoo``: :func:`register`'s, and the composed
    model checked against the zoo's registry; ``sweeps=False``: ``-m`` refused)."""
    register(zoo)
    warnings.filterwarnings(  # what conf/hydra/launcher/<plugin>.yaml wants: a wrong key in it fails; no 4-line notice
        "ignore", r"\s*'hydra/launcher/[^']+' is validated against ConfigStore schema with the same name", UserWarning
    )

    def decorate(fn: Callable[[DictConfig], Any]) -> Callable[[], Any]:
        @hydra.main(config_path=CONF_DIR, config_name=config_name, version_base="1.3")
        @functools.wraps(fn)
        def main(cfg: DictConfig) -> Any:
            try:
                check_sweeps_with_m(HydraConfig.get())
                check_known_keys(cfg, HydraConfig.get().overrides.task)
                typed = check_values(cfg)
                if zoo:
                    check_zoo_model(typed)
                return fn(cfg)
            except (UsageError, InterpolationResolutionError) as err:  # the command's end releases its folder
                release_refused(HydraConfig.get())
                exit_with(err if isinstance(err, UsageError) else one_line(err))

        return reporting_composition_errors(main, config_name, sweeps)

    return decorate


def register(zoo: bool = True) -> None:
    """What ``conf/`` composes on, each registered by its owner: the schema (:func:`src.config.store_schema`),
    ``${fresh:<folder>}`` (:func:`src.folders.register_fresh`), ``hydra/launcher=submitit_slurm``'s launcher among
    Hydra's plugins (:func:`src.jobs.slurm.register_launcher`); with ``zoo`` (``conf/config.yaml`` needs it, the report
    does not: it spares the report importing torch), the model zoo, whose import stores the ``model`` group's options
    and registers ``${models:}`` (:mod:`src.models.registry`)."""
    store_schema()
    register_fresh()
    from src.jobs.slurm import register_launcher  # no MLflow, no torch

    register_launcher()
    if zoo:
        import src.models  # noqa: F401


def check_zoo_model(typed: Config) -> None:
    """The model a run's config composes, against the zoo's registry: a model that is not registered, a switch it
    ignores set off its default (:func:`src.models.registry.check_model`)."""
    from src.models.registry import check_model  # the zoo: imported by register(zoo=True), never by the report

    check_model(typed.model)


def check_sweeps_with_m(hydra_cfg: DictConfig) -> None:
    """A :class:`UsageError` for a sweep's keys (a preset's, ``hydra.sweeper.params``) in a command without ``-m``,
    which Hydra would run once."""
    swept = OmegaConf.select(hydra_cfg, "sweeper.params") or {}
    if hydra_cfg.mode == RunMode.RUN and swept:
        raise UsageError(
            f"{', '.join(swept)}: swept by hydra.sweeper.params (a preset's), which runs one job without -m: add -m"
        )


def reporting_composition_errors(
    hydra_main: Callable[..., Any], config_name: str, sweeps: bool = True
) -> Callable[..., Any]:
    """Hydra prints a failed composition over several lines and exits 1: make it one ``error:`` line, exit 2; Ctrl-C
    outside a job one line, exit 130, not a traceback (SIGTERM and SIGHUP: 143 and 129). With ``HYDRA_FULL_ERROR=1``
    set by the user, Hydra's own report stands. A secret in an override's URI is concealed first
    (:func:`conceal_arguments`). At the end, the folders the command claimed and left as Hydra made them go
    (:func:`release_claimed`)."""

    @functools.wraps(hydra_main)
    def run(*args: Any) -> Any:
        for signum in (signal.SIGINT, signal.SIGTERM, *HANGUP):  # SIGINT: src's, while the modules were imported;
            signal.signal(signum, raise_stop)  # the others not their default: the command's cleanup (temp files) runs
        sys.argv[1:] = conceal_arguments(sys.argv[1:])  # a secret in a URI: *** in all Hydra saves, logs and hands on
        try:
            if os.environ.get(FULL_ERROR) == "1":
                return hydra_main(*args)
            return one_line_errors(hydra_main, config_name, sweeps, *args)
        except Exception as err:  # a library's cleanup that failed over a stop cutting it: the stop's end
            if (stop := interruption(err)) is None:
                raise
            end_stopped(stop)
        except (Stopped, KeyboardInterrupt) as stop:  # outside a job (a job checkpoints, then exits 128 + the signal)
            end_stopped(stop)
        finally:
            release_claimed()

    return run


def end_stopped(stop: BaseException) -> NoReturn:
    """End the command on a stop outside a job: one line, exit 128 + the signal."""
    signum = stop.signum if isinstance(stop, Stopped) else signal.SIGINT
    print(f"stopped ({'Ctrl-C' if signum == signal.SIGINT else signal.Signals(signum).name})", file=sys.stderr)
    sys.exit(128 + signum)


def raise_stop(signum: int, frame: Any) -> None:
    """A stop signal outside a job: Ctrl-C's :class:`KeyboardInterrupt` (as Python's own handler raises it), SIGTERM's
    or SIGHUP's :class:`Stopped`; now, or where the main thread is in an uninterrupted block (a data file's write) as
    the block ends, said on stderr."""
    if (doing := uninterrupted_now()) is not None:
        line = f"received {signal.Signals(signum).name}: stopping when {doing} is done\n"
        os.write(sys.stderr.fileno(), line.encode())  # not print: the handler may have cut a write to stderr
    when_uninterrupted(functools.partial(throw_stop, signum))


def throw_stop(signum: int) -> NoReturn:
    raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)


def one_line_errors(hydra_main: Callable[..., Any], config_name: str, sweeps: bool, *args: Any) -> Any:
    """``hydra_main(*args)`` on ``conf/<config_name>.yaml`` with Hydra's errors raised (``HYDRA_FULL_ERROR``), each
    printed as one line; ``-m`` refused unless the command ``sweeps``."""
    previous = os.environ.get(FULL_ERROR)
    os.environ[FULL_ERROR] = "1"
    try:
        sys.argv[1:] = hydra_arguments(sys.argv[1:], config_name)
        if not sweeps and {"-m", "--multirun"} & set(sys.argv[1:]):
            raise UsageError("-m: this command runs once, not as a sweep: give no -m")
        return hydra_main(*args)
    except (ConfigCompositionException, OverrideParseException) as err:
        exit_with(UsageError(composition_error(err, sys.argv[1:])))
    except UsageError as err:
        exit_with(err)
    except (HydraException, OmegaConfBaseException) as err:  # a search path, a sweep, an interpolation of the input
        exit_with(one_line(err))
    except ValueError as err:  # OmegaConf's, on a list's element named, not numbered (tags.x=a)
        if (line := list_index_error(err, sys.argv[1:])) is None:
            raise
        exit_with(UsageError(line))
    except OverflowError:  # OmegaConf's, converting an int past the float range (309 digits or more) to a float
        keys = [arg.partition("=")[0] for arg in sys.argv[1:] if re.search(r"\d{309}", arg)]
        exit_with(UsageError(f"{', '.join(keys) or 'a value'}: a number past the float range: give one below 1e308"))
    finally:
        if previous is None:
            del os.environ[FULL_ERROR]
        else:
            os.environ[FULL_ERROR] = previous


HELP = ("-h", "--help", "--hydra-help", "--version")  # Hydra prints and exits
SHELL_SUBCOMMANDS = ("install", "uninstall", "query")  # of --shell-completion


def hydra_arguments(argv: list[str], own: str) -> list[str]:
    """``argv`` with Hydra's flags (and their values) placed before the overrides, where its parser wants them
    (``model=x -m seed=0,1`` is ``-m model=x seed=0,1``, ``seed=1 --cfg job amp=true`` is ``--cfg job seed=1
    amp=true``), and ``--info`` without its value after them (``--info seed=1`` is ``seed=1 --info``); a
    :class:`UsageError` naming what Hydra refuses (an unknown flag, a flag without its value, two modes), in place of
    its usage lines or traceback; or a primary config other than the command's ``conf/<own>.yaml``."""
    parser = get_args_parser()
    parser.error = refuse  # type: ignore[method-assign]  # argparse's own: usage lines, then exit 2
    flags = parser._option_string_actions  # each flag of Hydra's parser, its action
    moved: list[int] = []  # the flags' places, each followed by its value's: --cfg job, -cn name, --info config
    last: list[int] = []  # a flag whose value is optional, given none (--info seed=1): after the overrides
    for i, arg in enumerate(argv):
        if arg not in flags or arg in HELP or (moved and moved[-1] == i):  # an override, or a flag's value
            continue
        follows, nargs = argv[i + 1 : i + 2], flags[arg].nargs
        value_follows = bool(follows) and "=" not in follows[0] and not follows[0].startswith("-")  # not an override
        valued = (bool(follows) and nargs is None) or (nargs == "?" and value_follows)
        if nargs == "?" and not valued:
            last.append(i)
        else:
            moved += [i, i + 1] if valued else [i]
    overrides = [arg for i, arg in enumerate(argv) if i not in moved + last]
    ordered = [argv[i] for i in moved] + overrides + [argv[i] for i in last]
    parsed = parser.parse_args([arg for arg in ordered if arg not in HELP])
    check_override_values(parsed.overrides)
    check_group_choices(parsed.overrides)
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
    if parsed.config_path is not None or parsed.config_name not in (None, own):
        given = f"-cp {parsed.config_path}" if parsed.config_path is not None else f"-cn {parsed.config_name}"
        raise UsageError(
            f"{given}: this command composes conf/{own}.yaml, whose Hydra settings it relies on: drop it (a recipe "
            f"of your own: --config-dir <folder> holding experiment/<name>.yaml, then experiment=<name>)"
        )
    if parsed.experimental_rerun is not None:
        refuse("--experimental-rerun: use rerun=<MLflow run id>, which trains a logged run's config again")
    if parsed.config_dir is not None:
        check_chosen_files(Path(parsed.config_dir), parsed.overrides)
    if parsed.shell_completion:
        shell_completion(parsed.overrides)
    return ordered


def check_chosen_files(folder: Path, overrides: list[str]) -> None:
    """The files of ``--config-dir`` the overrides choose (``experiment=<name>``: ``experiment/<name>.yaml``) loaded
    within an untrusted YAML's limits (:func:`load_yaml`) before Hydra composes them, unbounded: an alias bomb in an
    experiment file hung the command. One Hydra cannot load otherwise is Hydra's to name."""
    for text in overrides:
        key, _, values = text.lstrip("+~").partition("=")
        for value in values.split(","):
            path = folder / key.replace(".", "/") / f"{value}.yaml"
            with contextlib.suppress(OSError, yaml.YAMLError):  # absent, or not a file: Hydra names it
                if path.is_file():
                    load_yaml(path)


def check_override_values(overrides: list[str]) -> None:
    """Refuse a value Hydra's parser or basic sweeper fails on with a bare ``ValueError`` (a traceback, exit 1): an
    integer of more digits than Python reads (4,300), a ``range()`` with step 0."""
    parser = OverridesParser.create()
    for text in overrides:
        try:
            override = parser.parse_override(text)
            if override.is_sweep_override() and isinstance(override.value(), RangeSweep):
                next(iter(override.sweep_string_iterator()), None)
        except OverrideParseException:  # read, then refused by Hydra's check of it: its composition reports it
            continue
        except HydraException as err:  # the grammar cannot read it (an unquoted non-ASCII value): Hydra named neither
            raise UsageError(unreadable_override(text) or f"cannot parse the override {text}: {err}") from None
        except ValueError as err:
            key = text.partition("=")[0]
            raise UsageError(f"{key}: {str(err).partition(';')[0]}: give a value in the key's range") from None


def check_group_choices(overrides: list[str]) -> None:
    """Refuse a config group given a value no option is named by (``model=null``, ``optim=1``): Hydra fails on it
    with a traceback."""
    for override in overrides:
        group, _, value = override.partition("=")
        if not (options := group_options(group)):
            continue
        if value.lower() in ("null", "true", "false") or number(value):
            raise UsageError(f"{override} is not an option of {group}: use one of {', '.join(options)}")
        if listed(override) and not merging(group):
            raise UsageError(
                f"{override}: {group} takes one option, and a list of them merges them into one (the last one's "
                f"values win): give one, or sweep them: -m {group}=<option>,<option>"
            )


def group_options(group: str) -> list[str]:
    """The options of config group ``group`` (its files in conf/, its schemas in Hydra's ConfigStore); none for a key
    that is no group."""
    stored = ConfigStore.instance().repo.get(group) if group != "hydra" else None
    files = [path.name for path in (Path(CONF_DIR) / group).glob("*.yaml")] if group else []
    named = files + (list(stored) if isinstance(stored, dict) else [])
    return sorted({name.removesuffix(".yaml") for name in named})


def listed(override: str) -> bool:
    """Whether ``override`` gives a list, or sweeps one (``model=[a,b]``, ``-m model=[a,b],c``)."""
    try:
        value = OverridesParser.create().parse_override(override).value()
    except OverrideParseException:  # Hydra's composition reports it
        return False
    return any(isinstance(element, list) for element in (value.list if isinstance(value, ChoiceSweep) else [value]))


def merging(group: str) -> bool:
    """Whether ``group``'s options are global configs (presets, experiments), which a list merges."""
    files = list((Path(CONF_DIR) / group).glob("*.yaml"))
    return bool(files) and all(path.read_text().startswith("# @package _global_") for path in files)


def number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def shell_completion(overrides: list[str]) -> None:
    """Refuse what Hydra's ``--shell-completion`` would fail on with a traceback."""
    subcommands = [arg.partition("=") for arg in overrides if arg.partition("=")[0] in SHELL_SUBCOMMANDS]
    if len(subcommands) != 1 or subcommands[0][2] not in ("bash", "zsh", "fish"):
        refuse("--shell-completion takes one of install=<shell>, uninstall=<shell>, query=<shell> (bash, zsh, fish)")
    if subcommands[0][0] == "query" and "COMP_LINE" not in os.environ:
        refuse("--shell-completion query=<shell> is the shell's own call as it completes (COMP_LINE unset)")


def refuse(message: str) -> NoReturn:
    raise UsageError(f"{message} (the overrides are key=value; --help lists the flags)")
