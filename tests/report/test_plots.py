"""src/report/plots.py: the report's figures leave out the values they cannot draw."""

from __future__ import annotations

import numpy as np
import pandas as pd

from src.report.writer import FILES, report
from tests.report.helpers import amp_runs, report_config, store_with


def test_infinite_nan_and_negative_metrics_are_left_out_of_the_figures(tmp_path):
    logged = amp_runs()
    logged[0][1]["test/auc"], logged[1][1]["test/auc"] = float("inf"), float("nan")
    logged[2][1]["perf/samples_per_s_median"] = -5.0
    _, uri, _ = store_with(tmp_path, "bad", logged)
    out = report(report_config("mlflow.experiment=bad", f"mlflow.tracking_uri={uri}", f"out={tmp_path}/r"))
    assert {path.name for path in out.iterdir()} == set(FILES)
    assert np.isinf(pd.read_csv(out / "runs.csv")["test/auc"]).sum() == 1  # inf as logged, not the store's 1.8e308
    assert "Not drawn: 3 values of pairs (missing, infinite, negative" in (out / "report.md").read_text()
