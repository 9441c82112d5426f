"""MLflow: the store, one run per job under one parent run per sweep, batched logging, config identity."""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before any submodule imports mlflow
