"""Where runs are logged (``mlflow.*``): the store, and a training run's experiment and what it records."""

from __future__ import annotations

from dataclasses import dataclass

from src.config.ranges import EXPERIMENT_NAME_MAX, SAMPLE_INTERVAL_MAX_S, SAMPLE_INTERVAL_MIN_S
from src.config.rules import Range, Text, check_keys, key

EXPERIMENT_NAME = Text(limit=EXPERIMENT_NAME_MAX, whose="MLflow's limit for an experiment name")


@dataclass
class StoreConfig:
    tracking_uri: str | None = key(
        None,
        "the store; null: $MLFLOW_TRACKING_URI where set, else sqlite:///<project root>/mlflow.db",
        Text(null=True),
    )

    def __post_init__(self) -> None:
        check_keys(self, "mlflow")  # a subclass's keys too


@dataclass
class MlflowConfig(StoreConfig):
    experiment: str = key("medsweep", "the MLflow experiment of the runs", EXPERIMENT_NAME)
    system_metrics: bool = key(True, "MLflow's system metrics (CPU, memory, GPU) on each job's run, per node")
    system_metrics_interval_s: float = key(
        10.0,
        "seconds between system-metric samples",
        Range(
            SAMPLE_INTERVAL_MIN_S,
            SAMPLE_INTERVAL_MAX_S,
            "[]",
            fix=" (each sample writes to the store: 0.001 s slowed training 2.6x, docs/benchmarks.md)",
        ),
    )
    log_model: bool = key(False, "the tested weights (select_by) as an MLflow PyTorch model (the run's logged model)")
