"""``python -m src.train`` end to end in real processes, into a real MLflow store in a temp dir."""

from __future__ import annotations

import json

import mlflow
import pandas as pd
import pytest
from sklearn.metrics import balanced_accuracy_score, roc_auc_score

from src.models import MODELS
from tests.data.nifti.folders import bad_cases, prepare, six, spoil_gzip
from tests.helpers import BAD_INPUTS, RESULTS, history, run_cli, runs, small_run

CLINICAL = {"balanced_acc", "ece", "sensitivity", "specificity"}  # a binary task's
EPOCH_METRICS = {
    "train/loss",
    "train/acc",
    "val/loss",
    "val/acc",
    "val/auc",
    "perf/samples_per_s",
    "perf/step_ms",
    "perf/data_wait_frac",
    "mem/peak_mb",
    *(f"val/{k}" for k in CLINICAL),
}
STARTUP_PHASES = ("config", "mlflow", "data", "batch_size", "launch", "probes", "model")  # after imports, hydra
FINAL_METRICS = {
    "test/acc",
    "test/auc",
    "model/params",
    "time/total_s",
    "time/validate_s",
    "time/checkpoint_s",
    "stopped_epoch",
    "best_epoch",
    *(f"test/{k}" for k in CLINICAL),
    *(f"perf/samples_per_s_{k}" for k in ("median", "lo", "hi")),
    "perf/steps_timed",
}


def test_the_readme_sweep_logs_a_parent_and_two_finished_children(tmp_path, store, shared_data):
    result = run_cli(
        "-m",
        "model=densenet121",
        "amp=true,false",
        "data=adrenalmnist3d",
        f"data.root={shared_data}",
        "epochs=1",
        "limit_batches=2",
        f"mlflow.tracking_uri={store}",
        f"hydra.sweep.dir={tmp_path}/sweep",
        "batch_size=2",
    )  # DenseNet121 at 28^3 trains ~0.3 samples/s on 2 cores: keep the test short
    assert result.returncode == 0, result.stderr[-3000:]
    all_runs = runs(store)
    parents = [r for r in all_runs if r.data.tags.get("role") == "sweep"]
    children = [r for r in all_runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(children) == 2 and {r.info.status for r in children} == {"FINISHED"}
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    assert sorted(r.data.params["amp"] for r in children) == ["False", "True"]
    for run in children:
        assert set(run.data.metrics) >= EPOCH_METRICS | FINAL_METRICS
        params, tags = run.data.params, run.data.tags
        assert params["model.name"] == "densenet121" and params["effective_batch_size"] == "2"
        assert params["data.name"] == "adrenalmnist3d" and params["optim.name"] == "adam"
        assert {"config_hash", "git_commit", "torch_version", "cuda_version", "host", "overrides"} <= set(tags)
        assert tags["mem.source"] == "cpu_rss_peak_growth"
        assert tags["cuda_graphs"] == "false" and tags["cuda_graphs.eager_because"].startswith(
            "CUDA graphs need a CUDA"
        )
        artifacts = {a.path for a in mlflow.MlflowClient(store).list_artifacts(run.info.run_id)}
        assert {".hydra", "metrics.json", "eval"} <= artifacts
        evaluated = {a.path for a in mlflow.MlflowClient(store).list_artifacts(run.info.run_id, "eval")}
        assert evaluated == {"eval/confusion_matrix.png", "eval/test_predictions.csv"}
        assert run.data.metrics["model/params"] > 11e6 and run.data.metrics["perf/samples_per_s"] > 0
    assert len({r.data.tags["config_hash"] for r in children}) == 2
    startup = {r.data.tags["output_dir"][-1]: r.data.metrics for r in children}  # job number: its metrics
    assert {"time/startup/imports_s", "time/startup/hydra_s"} <= set(startup["0"])
    assert "time/startup/between_jobs_s" in startup["1"] and "time/startup/imports_s" not in startup["1"]
    for metrics in startup.values():
        phases = sum(v for k, v in metrics.items() if k.startswith("time/startup/"))
        assert phases == pytest.approx(metrics["time/startup_s"], rel=1e-6)
        assert {f"time/startup/{p}_s" for p in STARTUP_PHASES} <= set(metrics)
    job_dirs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert job_dirs == ["0", "1"]
    saved = json.loads((tmp_path / "sweep" / "0" / "metrics.json").read_text())
    assert set(saved) == FINAL_METRICS


def test_same_seed_reruns_are_bitwise_identical(tmp_path, store, shared_data):
    for name in ("a", "b"):
        result = run_cli(
            *small_run(tmp_path / name, store, shared_data, "seed=3", "deterministic=true", "skip_finished=false")
        )
        assert result.returncode == 0, result.stderr[-3000:]
    first, second = (history(store, r.info.run_id) for r in runs(store))
    for key in RESULTS:
        assert first[key] == second[key], key
    assert len(first["train/loss"]) == 2  # one value per epoch


@pytest.mark.slow
def test_another_seed_changes_the_run(tmp_path, store, shared_data):
    for seed in (1, 2):
        assert run_cli(*small_run(tmp_path / str(seed), store, shared_data, f"seed={seed}")).returncode == 0
    first, second = (history(store, r.info.run_id) for r in runs(store))
    assert first["train/loss"] != second["train/loss"]


@pytest.mark.slow
def test_bad_inputs_fail_in_one_line_and_touch_no_finished_run(tmp_path, store, shared_data):
    assert run_cli(*small_run(tmp_path / "ok", store, shared_data, "epochs=1")).returncode == 0
    (finished,) = runs(store)
    for overrides, message in BAD_INPUTS:
        result = run_cli(*small_run(tmp_path / "bad", store, shared_data, *overrides))
        assert result.returncode == 2, (overrides, result.stderr[-2000:])
        lines = result.stderr.strip().splitlines()
        assert [line for line in lines if line.startswith("error:")] == lines[-1:], (overrides, result.stderr[-2000:])
        assert lines[-1].startswith(f"error: {message}"), (overrides, lines[-1])
        assert "Traceback" not in result.stderr
    (after,) = runs(store)
    assert after.info.status == "FINISHED" and after.data.metrics == finished.data.metrics


def test_corrupt_npz_is_refused(tmp_path, store):
    (tmp_path / "adrenalmnist3d.npz").write_bytes(b"not a zip")
    result = run_cli(*small_run(tmp_path, store, tmp_path))
    assert result.returncode == 2
    assert (
        "adrenalmnist3d.npz has MD5" in result.stderr and "delete it and rerun with data.download=true" in result.stderr
    )


def test_unknown_model_group_option_names_the_choices(tmp_path, store, shared_data):
    result = run_cli(*small_run(tmp_path, store, shared_data, "model=resnet7"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: model=resnet7 is not an option of model: use one of {', '.join(sorted(MODELS))}"
    ]


@pytest.mark.slow
def test_a_job_failing_as_it_trains_stops_the_sweep_in_one_line_and_keeps_the_finished_child(
    tmp_path, store, shared_data
):
    """Job 2's second DDP rank dies (SIGKILL) at its first step: the job fails as it trains, after jobs 0 and 1
    finished; job 3 never starts."""
    ddp = ("parallel=none,ddp", "parallel.nproc=2", "fault.kill_rank=1", "seed=0,1")
    result = run_cli("-m", *small_run(tmp_path, store, shared_data, "epochs=1", *ddp))
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith("error: job 2 (") and "parallel=ddp" in line and "failed: " in line
    assert "job 3 not started" in result.stdout + result.stderr
    parent = next(r for r in runs(store) if r.data.tags.get("role") == "sweep")
    children = [r for r in runs(store) if r.data.tags.get("mlflow.parentRunId")]
    assert parent.info.status == "FAILED"
    assert sorted((r.data.params["parallel.mode"], r.info.status) for r in children) == [
        ("ddp", "FAILED"),
        ("none", "FINISHED"),
        ("none", "FINISHED"),
    ]


@pytest.mark.slow
def test_full_sweep_over_schedulers_and_loaders(tmp_path, store, shared_data):
    result = run_cli(
        "-m",
        *small_run(
            tmp_path, store, shared_data, "sched=multistep,cosine,cyclic", "data.loader=tensor,dataloader", "optim=sgd"
        ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    children = [r for r in runs(store) if r.data.tags.get("mlflow.parentRunId")]
    assert len(children) == 6 and {r.info.status for r in children} == {"FINISHED"}


@pytest.mark.slow
def test_the_accuracy_recipe_runs_as_written_and_logs_every_metric_and_artifact(tmp_path, store, shared_data):
    result = run_cli(
        "experiment=accuracy_cpu",
        "data=adrenalmnist3d",
        f"data.root={shared_data}",
        "data.download=false",
        "seed=0",
        "epochs=3",
        "warmup_epochs=1",
        "limit_batches=2",
        "num_threads=1",
        f"mlflow.tracking_uri={store}",
        f"hydra.run.dir={tmp_path}/run",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    assert set(run.data.metrics) >= EPOCH_METRICS | FINAL_METRICS
    params = run.data.params
    assert (params["model.name"], params["model.stem"], params["aug.name"], params["optim.name"]) == (
        "resnet18",
        "standard",
        "standard",
        "adamw",
    )
    client = mlflow.MlflowClient(store)
    predictions = pd.read_csv(client.download_artifacts(run.info.run_id, "eval/test_predictions.csv", str(tmp_path)))
    assert list(predictions.columns) == ["index", "label", "score_0", "score_1"] and len(predictions) == 2 * 32
    metrics = run.data.metrics  # anyone can recompute the logged test metrics from the predictions
    assert roc_auc_score(predictions["label"], predictions["score_1"]) == pytest.approx(metrics["test/auc"], abs=1e-6)
    assert balanced_accuracy_score(predictions["label"], (predictions["score_1"] > 0.5).astype(int)) == pytest.approx(
        metrics["test/balanced_acc"]
    )


@pytest.mark.parametrize(
    "case",
    ["missing-file", pytest.param("columns", marks=pytest.mark.slow), pytest.param("four-d", marks=pytest.mark.slow)],
)
def test_the_training_command_refuses_bad_input_in_one_line_before_any_run(tmp_path, store, case):
    data = tmp_path / "scans"
    prepare(data, case)
    overrides, start = bad_cases(data)[case]
    assert refused_before_any_run(tmp_path, store, data, *overrides).startswith(f"error: {start}")


@pytest.mark.slow
def test_the_training_command_refuses_a_volume_damaged_past_its_header_before_any_run(tmp_path, store):
    """A ``.nii.gz`` with a bad CRC: nibabel reads its header and voxels without seeing it (it trained, exit 0)."""
    data = six(tmp_path / "scans")
    spoil_gzip(data / "b1.nii.gz", "crc")
    trains = ("data.size=16", "model=resnet10", "batch_size=2", "epochs=1", "num_threads=1")
    line = refused_before_any_run(tmp_path, store, data, *trains, "mlflow.system_metrics=false")
    assert line.startswith(f"error: {data / 'labels.csv'} line 5: {data / 'b1.nii.gz'} is damaged (gzip: CRC")


def refused_before_any_run(tmp_path, store: str, data, *overrides: str) -> str:
    """``python -m src.train data=nifti`` on the folder ``data``: exit 2, one ``error:`` line, the last, and no run;
    that line."""
    result = run_cli(
        "data=nifti",
        f"data.root={data}",
        *overrides,
        "device=cpu",
        f"mlflow.tracking_uri={store}",
        f"hydra.run.dir={tmp_path}/run",
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]]
    assert runs(store) == []
    return lines[-1]
