"""``rerun=<MLflow run id>``: train a logged run's exact config again.

The config comes from the run's ``.hydra/config.yaml`` artifact (the job's resolved config), not from
composing today's ``conf/`` again, with the thread count the run trained with when its config left it to the machine.
Next to ``rerun=`` only keys that do not change results may be given (where it logs or finds data); the new run logs
to the store the run was found in, and to its experiment unless ``mlflow.experiment`` is given, under the name of the
run it repeats.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from src.config import Config
from src.config.bounded import load_yaml
from src.errors import UsageError
from src.tracking.identity import NOT_HASHED
from src.tracking.store import ensure_store, find_run, redacted

CONFIG_ARTIFACT = ".hydra/config.yaml"


def changed_keys(overrides: list[str]) -> list[str]:
    """The config keys the command line sets, ``rerun`` and ``resume`` (which pick the run) left out."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [key for key in (override.key_or_group for override in parsed) if key not in ("rerun", "resume")]


def with_command_line(stored: DictConfig, cfg: DictConfig, keys: list[str]) -> DictConfig:
    """``stored`` (a run's config) with ``keys`` set as the command line's ``cfg`` has them."""
    for key in keys:
        OmegaConf.update(stored, key, OmegaConf.select(cfg, key), merge=False)
    return stored


def logged_config(uri: str, run_id: str) -> tuple[DictConfig, mlflow.entities.Run]:
    """The run's ``.hydra/config.yaml``, typed by the schema, and the run (of the store at ``uri``)."""
    run = find_run(uri, run_id)
    if run is None:
        raise UsageError(
            f"rerun={run_id} is not a run in {redacted(uri)}: give a run id from that store "
            f"(or set mlflow.tracking_uri to the store that holds it)"
        )
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = ensure_store(uri).download_artifacts(run_id, CONFIG_ARTIFACT, folder)
        except (MlflowException, OSError):
            raise UsageError(
                f"rerun={run_id} has no {CONFIG_ARTIFACT} artifact (only finished runs log it): rerun a FINISHED run"
            ) from None
        try:  # the artifact is anyone's who logs to the store: loaded bounded (an alias bomb refused, no python tags)
            loaded = load_yaml(Path(path), f"rerun={run_id}: its {CONFIG_ARTIFACT} artifact")
            logged = OmegaConf.merge(OmegaConf.structured(Config), loaded)
            OmegaConf.to_object(logged)
        except (OmegaConfBaseException, ValueError, yaml.YAMLError) as err:  # YAMLError: a damaged artifact
            raise UsageError(
                f"rerun={run_id}: its logged config does not fit today's schema "
                f"({str(err).strip().splitlines()[0]}): check out the run's git_commit tag to rerun it"
            ) from None
    return logged, run


def rerun_config(cfg: DictConfig, overrides: list[str], uri: str) -> tuple[DictConfig, str]:
    """The config of run ``cfg.rerun`` (in the store at ``uri``), with the command line's non-result keys, that
    store, the thread count it trained with (its ``num_threads`` tag, where its config says null) and its micro-batch
    and accumulation (its params: ``batch_size=auto`` probed the memory free then, an ``oom_retry`` run halved the
    config's), and the run's name."""
    changed = changed_keys(overrides)
    fixed = [key for key in changed if not key.startswith(NOT_HASHED)]
    if fixed:
        raise UsageError(
            f"{fixed[0]} cannot change next to rerun={cfg.rerun}, which trains that run's config as it "
            f"was: drop {fixed[0]} (only {', '.join(k.rstrip('.') for k in NOT_HASHED)} may change)"
        )
    logged, run = logged_config(uri, cfg.rerun)
    rebuilt = with_command_line(logged, cfg, ["mlflow.tracking_uri", *changed])
    rebuilt.rerun = None
    if rebuilt.num_threads is None and (threads := run.data.tags.get("num_threads")):
        rebuilt.num_threads = int(threads)
    trained = [run.data.params.get(key, "") for key in ("batch_size", "accumulate")]
    if rebuilt.batch_size != "derived" and all(map(str.isdigit, trained)):  # auto: probed; oom_retry: halved
        rebuilt.batch_size, rebuilt.accumulate = map(int, trained)
    return rebuilt, run.data.tags.get(MLFLOW_RUN_NAME, run.info.run_name)
