"""src/config/report.py: the report's keys (``conf/report.yaml``): the margins' ranges, the model names ``register``
takes."""

from __future__ import annotations

import re

import pytest
from mlflow.exceptions import MlflowException
from mlflow.utils import validation

from tests.report.helpers import report_config


@pytest.mark.parametrize("key", ["speed_margin", "memory_margin"])
@pytest.mark.parametrize("value", ["-0.1", "1.5", "nan"])
def test_speed_and_memory_margins_outside_their_range_are_refused(key, value):
    message = f"{key}={value} must be in [0, 1] (a fraction of the baseline: 0.05 is 5%)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        report_config(f"{key}={value}")


@pytest.mark.parametrize("value", ["0", "1"])
def test_speed_and_memory_margin_edges_pass(value):
    cfg = report_config(f"speed_margin={value}", f"memory_margin={value}")
    assert cfg.speed_margin == cfg.memory_margin == float(value)
    assert report_config().speed_margin == report_config().memory_margin == 0.05  # the defaults


@pytest.mark.parametrize("name", [".", "..", "..x", ".x", "a..b", "x.", "a/b", "a:b", "best model-1.0"])
def test_the_model_names_register_refuses_are_mlflows(name):
    try:
        validation._validate_model_name(name)
        mlflow_refuses = False
    except MlflowException:
        mlflow_refuses = True
    try:
        report_config(f"register='{name}'")
        refused = False
    except ValueError as err:
        assert str(err).startswith(f"register={name}: MLflow's model names cannot")
        refused = True
    assert refused == mlflow_refuses
