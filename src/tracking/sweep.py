"""A sweep's parent run: opened by a Hydra callback, found by its jobs through a file in the sweep folder."""

from __future__ import annotations

import atexit
import logging
import sys
from pathlib import Path
from typing import Any

import mlflow
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from mlflow.entities import Run
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import DictConfig

from src.errors import UsageError
from src.schema_check import check_known_keys
from src.tracking.identity import code_fingerprint, run_name
from src.tracking.runs import RunLogger, environment_tags, user_tags
from src.tracking.store import check_store, ensure_store, search_all, tracking_uri
from src.tracking.ui import log_links

log = logging.getLogger(__name__)

PARENT_ID_FILE = "mlflow_parent_run_id"
SKIPPED_TAG = "skipped."  # on a sweep's parent run: skipped.<job number> = "<overrides> -> <finished run id>"


def read_parent_id(sweep_dir: Path) -> str | None:
    path = sweep_dir / PARENT_ID_FILE
    return path.read_text().strip() if path.exists() else None


def job_parent_id() -> str | None:
    """The parent run of the sweep this Hydra job belongs to; None outside a multirun."""
    hydra_cfg = HydraConfig.get()
    return read_parent_id(Path(hydra_cfg.sweep.dir)) if hydra_cfg.mode is RunMode.MULTIRUN else None


def parent_status(children: list[Run]) -> str:
    """A sweep's status from its jobs' runs: FINISHED when all finished; KILLED when some were preempted (KILLED,
    tagged ``preempted=true``) and none failed otherwise; else FAILED. An out-of-memory attempt that was retried
    (FAILED, tagged ``retried=true``) is no failure: its retry's run counts."""

    def marked(run: Run, status: str, tag: str) -> bool:
        return run.info.status == status and run.data.tags.get(tag) == "true"

    preempted = [run for run in children if marked(run, "KILLED", "preempted")]
    failed = [
        run
        for run in children
        if run.info.status != "FINISHED" and run not in preempted and not marked(run, "FAILED", "retried")
    ]
    return "FAILED" if failed else "KILLED" if preempted else "FINISHED"


def fail_parent_run(cfg: DictConfig) -> None:
    """A failed job of a sweep marks the sweep's parent run FAILED (its own run is already closed; it may have
    failed before it had one), which its close keeps."""
    if parent_id := job_parent_id():
        mlflow.MlflowClient(tracking_uri(cfg)).set_terminated(parent_id, "FAILED")


class SweepParentRun(Callback):
    """Hydra callback: one parent MLflow run per multirun, closed whatever happens to the jobs.

    Both ways it closes give it :func:`parent_status` of its jobs' runs: ``on_multirun_end``, and an
    ``atexit`` hook for when a job raises or is preempted (Hydra skips ``on_multirun_end`` then). A job that
    fails also marks it FAILED itself (its process may be a launcher's worker); the close keeps that.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """The sweep's parent run, after its keys and store are checked; a dry run only checks (creating no run and
        no store)."""
        uri = tracking_uri(config)
        try:
            check_known_keys(config, config.hydra.overrides.task)
            if config.dry_run:
                check_store(uri)
                return
            client = ensure_store(uri)
        except UsageError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        sweep_dir = Path(config.hydra.sweep.dir)
        overrides = " ".join(config.hydra.overrides.task)
        self.parent = RunLogger.start(
            client,
            config.mlflow.experiment,
            run_name(config.hydra.overrides.task, prefix=f"sweep {sweep_dir.name}"),
            params={},
            tags={
                "sweep_dir": str(sweep_dir.resolve()),
                "overrides": overrides,
                "role": "sweep",
                "code_fingerprint": code_fingerprint(),
                **environment_tags(),
                **user_tags(config.tags),
            },
        )
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / PARENT_ID_FILE).write_text(self.parent.run_id)
        atexit.register(self._close)
        log.info("MLflow parent run %s (%s)", self.parent.run_id, uri)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.dry_run:
            return
        atexit.unregister(self._close)
        self._close(complete=True)

    def _close(self, complete: bool = False) -> None:
        """Close with :func:`parent_status`; a sweep that did not reach its end (``atexit``) is not FINISHED."""
        client, run_id = self.parent.client, self.parent.run_id
        parent = client.get_run(run_id)
        of_sweep = f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{run_id}'"
        children = search_all(client, parent.info.experiment_id, of_sweep)
        if parent.info.status != "FAILED":  # else a job marked it
            status = parent_status(children)
            self.parent.finish("FAILED" if status == "FINISHED" and not complete else status)
        log_links(client.tracking_uri, parent.info.experiment_id, [run.info.run_id for run in children], of_sweep)
