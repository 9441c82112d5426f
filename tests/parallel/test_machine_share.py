"""A sweep's jobs running at once share the machine's cores and memory: real environments, real configs, real joblib
sweeps and single runs in real processes, a real MLflow store."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import joblib
import mlflow
import pytest
import torch
from hydra.types import RunMode
from omegaconf import OmegaConf

from src.config import ParallelMode
from src.errors import UsageError
from src.execution import resolve
from src.parallel import machine_share
from src.parallel.launch import job_device, launcher_jobs
from src.parallel.machine_share import FREE_ENV, GPU_JOBS_ENV, JOBS_ENV, SHARE_ENV
from src.perf.autobatch import check_fits
from src.perf.memory_cache import predicted
from src.training import checkpoint
from tests.helpers import ROOT, compose_config, on_cpu, run_cli, runs, small_run

CORES = len(os.sched_getaffinity(0))
CPU = torch.device("cpu")


@pytest.fixture
def clean_env(monkeypatch):
    for name in (JOBS_ENV, FREE_ENV, GPU_JOBS_ENV, SHARE_ENV):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_sweep_records_its_jobs_and_the_memory_free_and_puts_the_environment_back(clean_env):
    clean_env.setenv(JOBS_ENV, "7")  # a stray value, as a shell may hold
    with machine_share.shared(3):
        assert machine_share.jobs_at_once() == 3
        free = machine_share.free_at_start_mb()
        assert free is not None and free > 0
        assert machine_share.memory_share_mb() == pytest.approx(free / 3)
    assert os.environ[JOBS_ENV] == "7" and FREE_ENV not in os.environ
    with machine_share.shared(1):  # one job at a time: nothing shared, strays dropped
        assert machine_share.jobs_at_once() == 1 and machine_share.free_at_start_mb() is None
        assert JOBS_ENV not in os.environ


@pytest.mark.parametrize(
    "jobs,gpus,sharing",
    [(4, 1, [4, 4, 4, 4]), (3, 2, [2, 1, 2]), (4, 2, [2, 2, 2, 2]), (2, 2, [1, 1]), (2, 8, [1, 1])],
)
def test_jobs_beyond_the_gpus_share_them_and_each_plans_within_its_share(clean_env, jobs, gpus, sharing):
    """The GPU slots take the GPUs in turn (``launch.job_gpus``): job ``slot`` is on GPU ``slot % gpus``."""
    with machine_share.shared(jobs):
        assert [machine_share.gpu_jobs(slot, gpus) for slot in range(jobs)] == sharing
    with machine_share.sharing_gpu(4):
        assert machine_share.gpu_share_mb(free=70_000, total=80_000) == 20_000  # a quarter, not the first's all
        assert machine_share.gpu_share_mb(free=12_000, total=80_000) == 12_000  # at most what is free
    assert GPU_JOBS_ENV not in os.environ
    with machine_share.sharing_gpu(1):
        assert machine_share.gpu_share_mb(free=70_000, total=80_000) == 70_000


def test_a_job_plans_on_its_own_gpu():
    cuda = torch.device("cuda", 0)
    assert job_device(cuda, (2, 3)) == torch.device("cuda", 2)
    assert job_device(cuda, ()) == cuda and job_device(CPU, ()) == CPU


@pytest.mark.gpu
def test_two_jobs_on_one_gpu_each_plan_batch_size_auto_within_half_of_it(tmp_path, store, shared_data, monkeypatch):
    total_mb = torch.cuda.mem_get_info(0)[1] / 2**20
    overrides = small_run(tmp_path, store, shared_data, "device=cuda", "batch_size=auto", "epochs=1", "seed=0,1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    result = run_cli("-m", *overrides, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "gpu_share=none")
    assert result.returncode == 0, result.stderr[-3000:]
    budgets = [float(run.data.tags["batch.auto_budget_mb"]) for run in runs(store) if run.data.tags.get("batch.auto")]
    assert len(budgets) == 2 and all(budget <= total_mb / 2 + 1 for budget in budgets)


@pytest.mark.parametrize("value", ["", "abc", "0", "-2", "inf", "nan", "1e999"])
def test_a_value_no_sweep_could_record_counts_as_no_sweep(clean_env, value):
    clean_env.setenv(JOBS_ENV, value)
    clean_env.setenv(FREE_ENV, value)
    assert machine_share.jobs_at_once() == 1 and machine_share.free_at_start_mb() is None
    assert machine_share.memory_share_mb() == pytest.approx(machine_share.free_mb(), rel=0.2)


def test_the_jobs_at_once_divide_the_cores_and_the_ranks_divide_them_again(clean_env):
    cfg = OmegaConf.to_object(compose_config("num_threads=null", "device=cpu"))
    ddp = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, mode=ParallelMode.ddp, nproc=2))
    clean_env.setenv(JOBS_ENV, "2")
    assert resolve(cfg).threads == max(1, CORES // 2) and resolve(ddp).threads == max(1, CORES // 4)
    assert resolve(ddp).ranks_on_node == 2
    clean_env.setenv(JOBS_ENV, str(10 * CORES))
    assert resolve(cfg).threads == 1
    assert resolve(dataclasses.replace(cfg, num_threads=3)).threads == 3  # given: kept


def test_a_batch_that_fits_alone_but_not_beside_the_sweeps_other_jobs_is_refused_naming_n_jobs(clean_env, shared_data):
    cfg = OmegaConf.to_object(compose_config("model=resnet10", "batch_size=4", f"data.root={shared_data}"))
    execution = on_cpu(cfg)
    each = predicted(cfg, execution).total_mb
    clean_env.setenv(FREE_ENV, f"{2 * each:.0f}")  # fits alone (less the headroom), not 2 at once
    clean_env.setenv(JOBS_ENV, "1")
    check_fits(cfg, execution)
    clean_env.setenv(JOBS_ENV, "2")
    with pytest.raises(UsageError) as refused:
        check_fits(cfg, execution)
    assert "this job's share of the" in str(refused.value) and "(2 jobs of the sweep at once) less 15%" in str(
        refused.value
    )
    fewer = "run fewer jobs at once (hydra/launcher=joblib hydra.launcher.n_jobs=<n>: submitit_local runs every job"
    assert f": {fewer} at once), or lower batch_size" in str(refused.value)
    check_fits(dataclasses.replace(cfg, mem_budget_mb=2 * each), execution)  # a budget given is the job's own


@pytest.mark.parametrize("launcher", ["joblib", pytest.param("submitit_local", marks=pytest.mark.slow)])
def test_a_sweep_running_its_jobs_side_by_side_gives_each_its_share_of_the_cores(
    launcher, tmp_path, store, shared_data
):
    """joblib's 2 jobs at once (the shipped preset), submitit's local launcher every job at once: each job used to
    take every core, the jobs together twice as many threads as cores."""
    overrides = small_run(tmp_path, store, shared_data, "epochs=1", "limit_batches=1", "num_threads=null")
    result = run_cli("-m", *overrides, "seed=0,1", f"hydra/launcher={launcher}")
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = [run for run in runs(store) if run.data.tags.get("role") != "sweep"]
    assert len(jobs) == 2 and {run.data.tags["num_threads"] for run in jobs} == {str(max(1, CORES // 2))}


@pytest.mark.parametrize(
    "launcher,overrides,handed,at_once",
    [
        ("joblib", {}, 6, 2),  # the shipped n_jobs=2
        ("joblib", {"n_jobs": 8}, 3, 3),  # never more than the sweeper hands it
        ("joblib", {"n_jobs": -1}, 10_000, joblib.cpu_count()),
        ("submitit_local", {}, 5, 5),  # every job at once, each its own process
        ("submitit_slurm", {}, 5, 1),  # on SLURM's nodes
        (None, {}, 5, 1),  # Hydra's basic launcher: in turn, in this process
    ],
)
def test_the_jobs_a_launcher_runs_at_once_on_this_machine(launcher, overrides, handed, at_once):
    shipped = OmegaConf.load(ROOT / "conf" / "hydra" / "launcher" / f"{launcher}.yaml") if launcher else {}
    hydra_cfg = OmegaConf.create({"mode": RunMode.MULTIRUN, "launcher": OmegaConf.merge(shipped, overrides)})
    assert launcher_jobs(hydra_cfg, handed) == at_once
    hydra_cfg.mode = RunMode.RUN
    assert launcher_jobs(hydra_cfg, handed) == 1


def test_a_single_run_ignores_what_a_sweep_records_for_its_jobs(tmp_path, store, shared_data, clean_env):
    for name, value in ((JOBS_ENV, "64"), (FREE_ENV, "1"), (SHARE_ENV, "rogue")):
        clean_env.setenv(name, value)
    result = run_cli(*small_run(tmp_path, store, shared_data, "epochs=1", "limit_batches=1", "num_threads=null"))
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    assert run.data.tags["num_threads"] == str(CORES) and "gpu_share" not in run.data.tags


@pytest.mark.slow
def test_a_job_of_a_parallel_sweep_resumed_alone_keeps_the_threads_it_trained_with(tmp_path, store, shared_data):
    """Results change with the thread count: the checkpoint holds it, and the resumed run trains on with it."""
    shared = max(1, CORES // 2)
    overrides = small_run(tmp_path, store, shared_data, "num_threads=null", "fault.term_step=4")
    stopped = run_cli("-m", *overrides, "seed=0,1", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    run = next(run for run in runs(store) if run.data.tags.get("role") != "sweep")
    assert run.info.status == "KILLED"
    state = torch.load(Path(run.data.tags["output_dir"]) / checkpoint.FILE, weights_only=True)
    assert state["threads"] == shared
    again = run_cli(f"resume={run.info.run_id}", f"mlflow.tracking_uri={store}", f"hydra.run.dir={tmp_path}/again")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"rank 0/1 on cpu with {shared} threads" in again.stdout + again.stderr
    assert mlflow.MlflowClient(store).get_run(run.info.run_id).data.tags["num_threads"] == str(shared)


def test_a_single_run_drops_what_a_sweep_recorded_in_the_environment(clean_env):
    """A run started from a shell where a sweep's records were left (``conf/config.yaml``'s ``outside_sweep``
    callback) is no sweep's job: it takes the whole machine."""
    from hydra.utils import instantiate

    for name in (JOBS_ENV, FREE_ENV, GPU_JOBS_ENV, SHARE_ENV):
        clean_env.setenv(name, "2")
    callback = instantiate(OmegaConf.load(ROOT / "conf" / "config.yaml").hydra.callbacks.outside_sweep)
    callback.on_run_start(OmegaConf.create())
    assert not {JOBS_ENV, FREE_ENV, GPU_JOBS_ENV, SHARE_ENV} & set(os.environ)
    assert machine_share.jobs_at_once() == 1
