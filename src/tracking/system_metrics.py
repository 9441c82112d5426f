"""MLflow's own system metrics (``system/cpu_utilization_percentage``, ``system/system_memory_usage_megabytes``,
``system/gpu_0_utilization_percentage`` ...) on a job's run, sampled by one monitor per node."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from src.config import Config


@contextlib.contextmanager
def system_metrics(
    cfg: Config, run_id: str | None, uri: str, resumed: bool, node: str | None, monitors: bool
) -> Iterator[None]:
    """With ``mlflow.system_metrics``, MLflow's monitor samples this node every ``system_metrics_interval_s`` into
    ``run_id`` while the block runs, when this rank ``monitors`` (one per node does; a node of a multi-node job logs
    as ``system/<node>/...``). A resumed run's samples go on from its last step."""
    if not (cfg.mlflow.system_metrics and run_id and monitors):
        yield
        return
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # not four lines of start and stop per run
    monitor = SystemMetricsMonitor(
        run_id,
        sampling_interval=cfg.mlflow.system_metrics_interval_s,
        resume_logging=resumed,
        node_id=node,
        tracking_uri=uri,
    )
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()
