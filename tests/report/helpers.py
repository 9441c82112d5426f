"""What the report tests share: the report's config composed, its Markdown tables read, hand-made run frames, runs
logged by hand to a real store."""

from __future__ import annotations

from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
from hydra import compose, initialize_config_dir
from mlflow.entities import Metric, Param
from omegaconf import OmegaConf

from src.report.analysis import CONFIG_HASH, CONTENDED, DTYPE, PROVENANCE, STARTED, STEPS_TIMED
from src.report.runs import METRICS
from src.tracking.store import ensure_store
from tests.helpers import ROOT

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPORT_FILES = {"report.md", "report.html", "runs.csv", "effects.csv", "throughput_memory.png", "paired_effects.png"}
MARGINS = {"margin": 0.01, "speed_margin": 0.05, "memory_margin": 0.05}  # the defaults
LONG = "x" * 300  # a path part past the file system's 255 bytes


def report_config(*overrides: str):
    """The real composition of ``conf/report.yaml``, typed."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_object(compose("report", overrides=list(overrides)))


def tables(markdown: str) -> dict[str, list[dict[str, str]]]:
    """Each ``## section``'s Markdown table as rows of ``{header: cell}``."""
    found = {}
    for section in markdown.split("\n## ")[1:]:
        lines = [line for line in section.splitlines() if line.startswith("| ")]
        if lines:
            header, *rows = ([cell.strip() for cell in line[2:-2].split(" | ")] for line in lines)
            found[section.splitlines()[0]] = [dict(zip(header, row, strict=True)) for row in rows[1:]]
    return found


# test AUC of model.activation=<value> minus gelu (the baseline) for seeds 0-3: clearly above, clearly below and
# straddling -0.01
DIFFERENCES = {
    "mish": [0.002, 0.004, 0.003, 0.003],
    "prelu": [-0.05, -0.06, -0.055, -0.055],
    "relu": [0.0, -0.01, 0.0, -0.01],
}


def activation_runs() -> pd.DataFrame:
    """model.activation x seed=0..3 (a run frame as the report reads one), test AUCs differing by DIFFERENCES."""
    rows = [
        {
            "model.activation": value,
            "seed": str(seed),
            "test/auc": 0.8 + 0.01 * seed + difference,
            "perf/samples_per_s": 100.0 - 10 * i,
            "mem/peak_mb": 500.0 + 100 * i,
        }
        for seed in range(4)
        for i, (value, difference) in enumerate([("gelu", 0.0), *((v, d[seed]) for v, d in DIFFERENCES.items())])
    ]
    return pd.DataFrame(rows)


# samples/s and peak memory of model.block=<value> over v0 (the baseline) for seeds 0-3: clearly above the 5% band,
# clearly below it, inside it, straddling its upper edge (mean inside) and its lower edge (mean below)
RATIOS = {
    "v1": [1.50, 1.55, 1.45, 1.52],
    "v2": [0.60, 0.62, 0.58, 0.61],
    "v3": [1.00, 1.01, 0.99, 1.005],
    "v4": [1.00, 1.06, 1.02, 1.08],
    "v5": [0.90, 0.96, 0.92, 0.98],
}


def block_runs(**columns) -> pd.DataFrame:
    """model.block x seed=0..3 with samples/s, peak memory (and test AUC, 0.1 per unit) over v0 as RATIOS;
    ``columns``: the same value in every run."""
    rows = [
        {
            "model.block": value,
            "seed": str(seed),
            "perf/samples_per_s": 100 * ratio,
            "mem/peak_mb": 1000 * ratio,
            "test/auc": 0.8 + 0.1 * (ratio - 1),
            **columns,
        }
        for value, ratios in {"v0": [1.0] * 4, **RATIOS}.items()
        for seed, ratio in enumerate(ratios)
    ]
    return pd.DataFrame(rows)


def as_run_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """Hand-made runs as ``run_frame`` gives them: ids, FINISHED, started in turn, every metric (NaN unless given),
    and as runs logged before steps were counted and runs tagged (not contended, steps, precision and configuration
    unknown) unless given."""
    defaults = {
        **dict.fromkeys(METRICS, np.nan),
        STEPS_TIMED: np.nan,
        CONTENDED: False,
        **dict.fromkeys([DTYPE, CONFIG_HASH, *PROVENANCE], ""),
    }
    return runs.assign(
        run_id=[f"run{i}" for i in range(len(runs))],
        **{STARTED: range(len(runs))},
        status="FINISHED",
        **{key: value for key, value in defaults.items() if key not in runs},
    )


def log_run(
    client: mlflow.MlflowClient,
    experiment_id: str,
    params: dict[str, str],
    epochs: list[dict[str, float]],
    final: dict[str, float],
    status: str = "FINISHED",
    tags: dict[str, str] | None = None,
) -> str:
    run = client.create_run(experiment_id, tags=tags or {})
    client.log_batch(
        run.info.run_id,
        params=[Param(k, v) for k, v in params.items()],
        metrics=[Metric(k, v, 0, step) for step, values in enumerate(epochs) for k, v in values.items()]
        + [Metric(k, v, 0, len(epochs)) for k, v in final.items()],
    )
    client.set_terminated(run.info.run_id, status)
    return run.info.run_id


def store_with(tmp_path: Path, experiment: str, runs: list[tuple[dict, dict, dict]], artifacts: str = "artifacts"):
    """A fresh store holding ``experiment`` (its artifacts in ``artifacts`` under ``tmp_path``) with FINISHED
    ``runs`` (params, final metrics, tags); the client, the store's URI and the experiment's id."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = ensure_store(uri)
    experiment_id = client.create_experiment(experiment, artifact_location=str(tmp_path / artifacts))
    for params, final, tags in runs:
        log_run(client, experiment_id, params, [], final, tags=tags)
    return client, uri, experiment_id


def amp_runs(repeats: int = 1, **final) -> list[tuple[dict, dict, dict]]:
    """amp=true,false x seed=0,1, ``repeats`` times (a sweep rerun with skip_finished=false: same config_hash)."""
    return [
        (
            {"amp": amp, "seed": str(seed)},
            {
                "test/auc": 0.8 + 0.01 * (amp == "True") + 0.001 * repeat,
                "perf/samples_per_s_median": 10.0 + seed,
                "mem/peak_mb": 100.0,
                **final,
            },
            {CONFIG_HASH: f"{amp}-{seed}"},
        )
        for repeat in range(repeats)
        for amp in ("True", "False")
        for seed in (0, 1)
    ]
