"""MLflow: the store, one run per job under one parent run per sweep, batched logging, config identity."""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before any submodule imports mlflow
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no tqdm bar in job logs (rerun=, uploads)
