"""A run's tested weights as an MLflow PyTorch model (MLflow 3's logged model), its test metrics linked to it.

The model is the network at its tested weights (the epoch ``select_by`` chose), in float32 on the CPU, pickled
with a copy of the ``src`` package (``code_paths``), so ``mlflow.pytorch.load_model("models:/<model id>")`` loads
it without a medsweep checkout. It maps ``src.data.loaders.to_input`` volumes, float32 ``(N, C, D, H, W)`` in
[-1, 1], to logits; ``softmax(1)`` of them are the run's test scores (``eval/test_predictions.csv``).
"""

from __future__ import annotations

import copy

import torch
from mlflow.entities import LoggedModelOutput

from src.tracking.identity import PACKAGE
from src.tracking.runs import RunLogger

NAME = "model"


def log_model(run: RunLogger, model: torch.nn.Module, example: torch.Tensor, step: int) -> str:
    """Log ``model`` (a copy, float32, CPU, eval mode) as the model of ``run`` at ``step``, its signature taken on
    ``example`` (a batch of inputs); returns its model id. Metrics logged with it are linked to it."""
    import mlflow
    import mlflow.pytorch
    from mlflow.models import infer_signature

    model = copy.deepcopy(model).float().cpu().eval().to(memory_format=torch.contiguous_format)
    example = example.float().cpu().contiguous()
    with torch.no_grad():
        signature = infer_signature(example.numpy(), model(example).numpy())
    client = run.client
    logged = client.get_run(run.run_id)
    created = client.create_logged_model(
        logged.info.experiment_id,
        name=NAME,
        source_run_id=run.run_id,
        params=logged.data.params,
        model_type="classifier",
    )
    mlflow.set_tracking_uri(client.tracking_uri)  # mlflow.pytorch logs through the fluent API's store
    mlflow.pytorch.log_model(
        model,
        name=NAME,
        model_id=created.model_id,
        signature=signature,
        code_paths=[str(PACKAGE)],
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}"],
        serialization_format="pickle",  # 'pt2' needs torch.export of every architecture and switch
    )
    client.log_outputs(run.run_id, [LoggedModelOutput(created.model_id, step)])
    return created.model_id
