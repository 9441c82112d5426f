"""``dry_run=true``: one line per job and a total, printed by real processes against a real SQLite store in a temp
dir; nothing trains and the store is left byte for byte as it was (or not created)."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import statistics
from pathlib import Path

import pytest

from src.jobs.dry_run import TIMED_STEPS, job_seconds, rounded
from src.jobs.resume import Resume
from src.perf.autobatch import CPU_HEADROOM
from src.perf.memory import predict
from src.resolve import validate
from src.tracking.identity import config_hash, flatten, run_name
from tests.helpers import compose_config, run_cli, runs, small_run
from tests.test_train import BAD_INPUTS


def store_files(folder: Path) -> dict[str, str]:
    """The SHA-256 of the store's database and of every file in its artifact folder."""
    paths = [folder / "mlflow.db", *sorted((folder / "mlartifacts").rglob("*"))]
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in paths if path.is_file()}


def listed(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(("job ", "total: "))]


def job_overrides(tmp_path: Path, store: str, shared_data: Path, *overrides: str) -> list[str]:
    """A job's overrides in ``small_run``, Hydra's own settings left out."""
    return [o for o in small_run(tmp_path, store, shared_data, *overrides) if not o.startswith("hydra.")]


def job_name(overrides: list[str]) -> str:
    """The run name of a job with ``overrides`` (a long one ends with its config hash)."""
    return run_name(overrides, config_hash(flatten(compose_config(*overrides))))


def job(tmp_path: Path, store: str, shared_data: Path, seed: int) -> tuple[str, float]:
    """A job's run name and predicted peak (MiB), as the dry run of ``small_run`` at ``seed`` and one epoch has them."""
    overrides = job_overrides(tmp_path, store, shared_data, "epochs=1", f"seed={seed}")
    cfg, device = validate(compose_config(*overrides))
    return job_name(overrides), predict(cfg, device).total_mb


@pytest.mark.slow
def test_a_dry_sweep_lists_two_runs_and_two_skips_and_leaves_the_store_as_it_was(tmp_path, store, shared_data):
    finished = run_cli("-m", *small_run(tmp_path / "done", store, shared_data, "epochs=1", "seed=0,1"))
    assert finished.returncode == 0, finished.stderr[-3000:]
    done = {r.data.params["seed"]: r for r in runs(store) if r.data.tags.get("mlflow.parentRunId")}
    assert sorted(done) == ["0", "1"] and {r.info.status for r in done.values()} == {"FINISHED"}
    before = store_files(tmp_path)

    result = run_cli("-m", *small_run(tmp_path / "dry", store, shared_data, "epochs=1", "seed=0,1,2,3", "dry_run=true"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert store_files(tmp_path) == before  # no run, no sweep parent run, no tag, no artifact
    cfg = validate(compose_config(*job_overrides(tmp_path, store, shared_data, "epochs=1")))[0]
    rate = statistics.median(r.data.metrics["perf/samples_per_s"] for r in done.values())  # same speed: seed differs
    minutes = job_seconds(cfg, 1, rate) / 60
    expected = []
    for seed in range(4):
        name, peak = job(tmp_path, store, shared_data, seed)
        action, estimate = (
            (f"skip: finished run {done[str(seed)].info.run_id}", "0 min")
            if str(seed) in done
            else ("run", f"~{rounded(minutes)} min (from 2 finished runs)")
        )
        expected.append(f"job {seed}: {name} | {action} | peak {peak:.0f} MiB at batch 4 | {estimate}")
    expected.append(f"total: 2 to run, 2 to skip | ~{rounded(2 * minutes)} min | largest peak {peak:.0f} MiB")
    assert listed(result.stdout) == expected


@pytest.mark.slow
def test_a_parallel_dry_sweep_on_a_store_not_created_yet_times_the_jobs_and_creates_nothing(
    tmp_path, store, shared_data
):
    result = run_cli(
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        *small_run(tmp_path, store, shared_data, "epochs=1", "seed=0,1", "dry_run=true"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlartifacts").exists()
    *jobs, last = listed(result.stdout)  # the jobs' lines come from two worker processes, in any order
    assert len(jobs) == 2
    for seed, line in enumerate(sorted(jobs)):
        name, peak = job(tmp_path, store, shared_data, seed)
        prefix = f"job {seed}: {name} | run | peak {peak:.0f} MiB at batch 4 | ~"
        assert line.startswith(prefix) and re.fullmatch(
            rf"[0-9.e-]+ min \(timed {TIMED_STEPS} steps\)", line[len(prefix) :]
        )
    assert re.fullmatch(rf"total: 2 to run, 0 to skip \| ~[0-9.e-]+ min \| largest peak {peak:.0f} MiB", last)


@pytest.mark.slow
def test_a_single_dry_run_of_batch_size_auto_lists_the_predicted_batch_unprobed_and_its_total(
    tmp_path, store, shared_data
):
    """With a warm-up schedule too: the timed steps are one epoch, which a warm-up must not refuse."""
    auto = ("epochs=2", "warmup_epochs=1", "batch_size=auto", "effective_batch_size=8")
    cfg, device = validate(compose_config(*job_overrides(tmp_path, store, shared_data, *auto)))
    budget = predict(cfg, device, 4).total_mb / (1 - CPU_HEADROOM) + 1  # room for 4 per step, not 8 (test_measure's)
    overrides = job_overrides(tmp_path, store, shared_data, *auto, f"mem_budget_mb={budget}")
    peak = predict(dataclasses.replace(cfg, batch_size=4, accumulate=2), device).total_mb
    result = run_cli(*small_run(tmp_path, store, shared_data, *auto, f"mem_budget_mb={budget}", "dry_run=true"))
    assert result.returncode == 0, result.stderr[-3000:]
    line, last = listed(result.stdout)
    prefix = f"job 0: {job_name(overrides)} | run | peak {peak:.0f} MiB at batch 4 | ~"
    assert line.startswith(prefix) and re.fullmatch(
        rf"[0-9.e-]+ min \(timed {TIMED_STEPS} steps\)", line[len(prefix) :]
    )
    assert re.fullmatch(rf"total: 1 to run, 0 to skip \| ~[0-9.e-]+ min \| largest peak {peak:.0f} MiB", last)
    assert "batch_size=auto: batch_size=" not in result.stdout + result.stderr  # fit_batch's line after its probe
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_bad_input_and_an_optuna_sweep_fail_a_dry_run_in_one_line_before_anything(tmp_path, store, shared_data):
    checked_by_the_dry_run = ("data.root=/nonexistent", "batch_size=2000")  # the others are refused by plan_job
    for overrides, message in [case for case in BAD_INPUTS if case[0][0] in checked_by_the_dry_run]:
        result = run_cli(*small_run(tmp_path, store, shared_data, "dry_run=true", *overrides))
        assert result.returncode == 2, (overrides, result.stderr[-2000:])
        assert result.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), (overrides, result.stderr)
        assert listed(result.stdout) == []
    optuna = run_cli("-m", "preset=optuna", *small_run(tmp_path, store, shared_data, "dry_run=true"))
    assert optuna.returncode == 2, optuna.stderr[-2000:]
    assert optuna.stderr.strip().splitlines() == [
        "error: dry_run=true lists the jobs of a grid sweep, known before any runs; hydra_plugins.hydra_optuna_sweeper."
        "optuna_sweeper.OptunaSweeper picks each trial from the results of those before it: drop dry_run (finished "
        "trials are skipped)"
    ]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "sweep").exists()


def test_a_jobs_time_is_its_trained_samples_and_a_third_of_its_evaluated_ones_at_the_training_rate(
    tmp_path, store, shared_data
):
    def seconds(*overrides: str, world: int = 1, resume: Resume | None = None) -> float:
        cfg = validate(compose_config(*job_overrides(tmp_path, store, shared_data, *overrides)))[0]
        return job_seconds(cfg, world, 10.0, resume)

    # AdrenalMNIST3D: 1188 train, 98 val, 298 test; batch 4, 2 epochs of 3 batches: 24 trained, 2 x 12 + 12 evaluated
    assert seconds() == pytest.approx((24 + 36 / 3) / 10)
    assert seconds("limit_batches=null", "epochs=1") == pytest.approx((297 * 4 + (98 + 298) / 3) / 10)
    # resumed at epoch 1, step 1: 2 steps of 4 left, one validation and the test
    resume = Resume("id", tmp_path, epoch=1, step=1, batch_size=4, accumulate=1, world=1)
    assert seconds(resume=resume) == pytest.approx((8 + 24 / 3) / 10)
    # DDP, 2 ranks: 594 samples and 148 batches of 4 per rank; rank 0 evaluates alone, at half the summed rate
    ddp = seconds("limit_batches=null", "epochs=1", "parallel=ddp", "parallel.nproc=2", world=2)
    assert ddp == pytest.approx(148 * 4 * 2 / 10 + (98 + 298) / 3 / 5)
