"""MLflow's own system metrics (``system/cpu_utilization_percentage``, ``system/system_memory_usage_megabytes``,
``system/gpu_0_utilization_percentage`` ...) on a job's run, sampled by one monitor per node."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

from src.config import Config
from src.parallel.dist import Rank


def node_id(rank: Rank) -> str | None:
    """``node<k>`` on a job of several nodes (its metrics are kept apart: ``system/node<k>/...``), else None."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", rank.world))
    if per_node >= rank.world:
        return None
    return f"node{os.environ.get('GROUP_RANK', rank.rank // per_node)}"


@contextlib.contextmanager
def system_metrics(cfg: Config, rank: Rank, run_id: str | None, uri: str, resumed: bool) -> Iterator[None]:
    """With ``mlflow.system_metrics``, MLflow's monitor samples this node every ``system_metrics_interval_s`` into
    ``run_id`` while the block runs; only one rank per node (local rank 0) monitors. A resumed run's samples go on
    from its last step."""
    if not (cfg.mlflow.system_metrics and run_id and rank.local_rank == 0):
        yield
        return
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # not four lines of start and stop per run
    monitor = SystemMetricsMonitor(
        run_id,
        sampling_interval=cfg.mlflow.system_metrics_interval_s,
        resume_logging=resumed,
        node_id=node_id(rank),
        tracking_uri=uri,
    )
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()
