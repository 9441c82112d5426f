"""DDP (real gloo ranks on CPU) and DP inside Hydra jobs, parallel sweep jobs, torchrun, submitit."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import uuid
from datetime import timedelta
from pathlib import Path

import mlflow
import pytest
import torch

from src.data import SeededPermutation, TensorLoader
from src.errors import UsageError
from src.parallel import dist
from tests.helpers import ROOT, free_port, history, run_cli, run_process, runs, small_run


def children(store: str) -> list[mlflow.entities.Run]:
    return [r for r in runs(store) if r.data.tags.get("mlflow.parentRunId")]


def tagged_processes(tag: str) -> list[int]:
    """PIDs of live processes that inherited ``MEDSWEEP_TEST_TAG=tag`` (ranks, launcher workers)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"MEDSWEEP_TEST_TAG={tag}".encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def run_tagged(*args: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess, str]:
    tag = uuid.uuid4().hex
    os.environ["MEDSWEEP_TEST_TAG"] = tag
    try:
        return run_cli(*args, timeout=timeout), tag
    finally:
        del os.environ["MEDSWEEP_TEST_TAG"]


def test_rank_shards_together_are_the_single_process_batches():
    whole = SeededPermutation(101, seed=5).order()
    shards = [SeededPermutation(101, seed=5, rank=r, world=2).order() for r in range(2)]
    assert [len(s) for s in shards] == [50, 50]
    for step in range(6):  # batch 8 per rank == batch 16 in one process, as sets
        ranks = torch.cat([s[8 * step : 8 * step + 8] for s in shards])
        assert sorted(ranks.tolist()) == sorted(whole[16 * step : 16 * step + 16].tolist())


@pytest.mark.parametrize(("n", "batch"), [(41, 3), (1335, 4), (101, 8), (1188, 4)])
def test_ranks_take_the_single_process_steps_and_no_sample_twice(n, batch):
    """An odd split at 2 ranks: 1,335 (VesselMNIST3D) at 2 x 4 took 167 steps, one sample twice, where one process
    at 8 takes 166."""
    one = TensorLoader(torch.arange(n), torch.arange(n), 2 * batch, SeededPermutation(n, 3), drop_last=True)
    ranks = [
        TensorLoader(torch.arange(n), torch.arange(n), batch, SeededPermutation(n, 3, rank=r, world=2), drop_last=True)
        for r in range(2)
    ]
    assert len(ranks[0]) == len(ranks[1]) == len(one)
    for whole, *shards in zip(one, *ranks, strict=True):
        assert sorted(torch.cat([images for images, _ in shards]).tolist()) == sorted(whole[0].tolist())


def test_rendezvous_holds_its_port_until_the_job_ends():
    with dist.rendezvous(timeout_s=30) as first, dist.rendezvous(timeout_s=30) as second:
        assert first != second
        port = int(first.rpartition(":")[2])
        with socket.socket() as taker, pytest.raises(OSError, match="in use"):
            taker.bind(("127.0.0.1", port))  # bound by this process from the start: no rank can lose it
        client = torch.distributed.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
        client.set("rank", "0")
        assert client.get("rank") == b"0"


def test_gpu_slots_are_exclusive(tmp_path):
    with dist.gpu_slot(tmp_path, 2) as first, dist.gpu_slot(tmp_path, 2) as second:
        assert (first, second) == (0, 1)
        message = f"all 2 GPU slots in {tmp_path} are taken: lower hydra.launcher.n_jobs"
        with pytest.raises(UsageError, match=f"^{re.escape(message)}$"), dist.gpu_slot(tmp_path, 2):
            pass
    with dist.gpu_slot(tmp_path, 2) as again:
        assert again == 0  # released when the job ends


@pytest.mark.slow
def test_ddp_follows_the_single_process_loss_trajectory(tmp_path, store, shared_data):
    """parallel=ddp nproc=2 batch 8 == parallel=none batch 16 over 20 steps (GroupNorm: batch-independent)."""
    common = ("model.norm=group", "epochs=20", "limit_batches=1", "seed=11", "optim.lr=0.003")
    single = run_cli(
        *small_run(tmp_path / "single", store, shared_data, *common, "batch_size=16", "mlflow.experiment=single")
    )
    assert single.returncode == 0, single.stderr[-3000:]
    ddp = run_cli(
        *small_run(
            tmp_path / "ddp",
            store,
            shared_data,
            *common,
            "batch_size=8",
            "parallel=ddp",
            "parallel.nproc=2",
            "mlflow.experiment=ddp",
        )
    )
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    (one,), (two,) = runs(store, "single"), runs(store, "ddp")
    assert two.data.params["effective_batch_size"] == "16" and two.data.params["world_size"] == "2"
    losses = [[v for _, v in history(store, r.info.run_id)["train/loss"]] for r in (one, two)]
    assert len(losses[0]) == len(losses[1]) == 20
    assert losses[0][0] != losses[0][-1]  # it trains
    # float32 sums in another order (one batch of 16 against two of 8 and an all-reduce): up to 2.05e-5 apart over the
    # 20 steps on an Intel Xeon (2026-11-27), under 1e-5 on the AMD EPYCs before
    assert max(abs(a - b) for a, b in zip(*losses, strict=True)) < 1e-4
    assert {"mem/peak_mb/rank0", "mem/peak_mb/rank1"} <= set(two.data.metrics)


def test_ddp_ranks_stop_early_together(tmp_path, store, shared_data):
    """Only rank 0 validates: its early stop is every rank's (rank 1 trained on alone, the run FAILED)."""
    stop = ("epochs=4", "limit_batches=1", "early_stop_patience=1", "optim.lr=0", "model.norm=group")
    ddp = ("parallel=ddp", "parallel.nproc=2", "parallel.timeout_s=60")
    result = run_cli(*small_run(tmp_path, store, shared_data, *stop, *ddp))  # lr 0, GroupNorm: val/loss stays
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["stopped_epoch"] == 2 and run.data.metrics["best_epoch"] == 1


def test_a_diverged_rank_fails_the_ddp_run_as_diverged_in_one_line(tmp_path, store, shared_data):
    """A rank's Diverged reached the job's process as torch's ProcessRaisedException: a traceback, exit 1."""
    ddp = ("parallel=ddp", "parallel.nproc=2", "parallel.timeout_s=60", "model.norm=group", "optim.lr=1e308")
    result = run_cli(*small_run(tmp_path, store, shared_data, *ddp))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: training diverged: train/loss is nan at epoch 1")
    (run,) = runs(store)
    assert run.info.status == "FAILED" and run.data.tags["status"] == "diverged"
    assert not list(tmp_path.rglob("diverged_rank*.txt"))


@pytest.mark.slow
def test_joblib_sweep_of_ddp_jobs_logs_each_job_once(tmp_path, store, shared_data):
    result, tag = run_tagged(
        "-m",
        "parallel=ddp",
        "parallel.nproc=2",
        "amp=true,false",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        *small_run(tmp_path, store, shared_data, "epochs=1", "limit_batches=2"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = children(store)
    assert len(jobs) == 2 and {r.info.status for r in jobs} == {"FINISHED"}
    assert sorted(r.data.params["amp"] for r in jobs) == ["False", "True"]
    for run in jobs:
        assert all(len(values) == 1 for values in history(store, run.info.run_id).values())  # logged once, not per rank
    parent = next(r for r in runs(store) if r.data.tags.get("role") == "sweep")
    assert parent.info.status == "FINISHED"
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0", "1"]
    assert not (tmp_path / "run").exists() and tagged_processes(tag) == []


@pytest.mark.slow
def test_a_killed_rank_fails_the_job_and_leaves_no_process(tmp_path, store, shared_data):
    """A hang would hit run_cli's timeout (the process group is killed then); a healthy failure takes ~20 s."""
    result, tag = run_tagged(
        *small_run(
            tmp_path,
            store,
            shared_data,
            "parallel=ddp",
            "parallel.nproc=2",
            "epochs=50",
            "fault.kill_rank=1",
            "fault.kill_step=2",
        ),
    )
    left = tagged_processes(tag)
    for pid in left:  # no stray ranks after a failing assertion
        os.kill(pid, signal.SIGKILL)
    assert result.returncode != 0
    assert "SIGKILL" in result.stderr
    (run,) = runs(store)
    assert run.info.status == "FAILED" and left == []


@pytest.mark.parametrize(
    "override,message",
    [
        ("parallel=dp", "parallel=dp needs 2 or more visible GPUs (found 0): use parallel=ddp"),
        ("parallel.sync_bn=true", "parallel.sync_bn=true needs NCCL on CUDA"),
        ("parallel.backend=nccl", "parallel.backend=nccl needs CUDA devices"),
    ],
)
def test_parallel_settings_that_cannot_run_here_fail_first(tmp_path, store, shared_data, override, message):
    result = run_cli(*small_run(tmp_path, store, shared_data, "parallel=ddp", override))
    assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1]
    assert runs(store) == []


@pytest.mark.slow
def test_torchrun_ranks_join_and_rank0_alone_logs(tmp_path, store, shared_data):
    torchrun = shutil.which("torchrun") or pytest.fail("torchrun ships with torch")
    outputs = tmp_path / "outputs"
    result = run_process(
        [
            torchrun,
            "--standalone",  # its own rendezvous on a port it binds itself
            "--nproc_per_node=2",
            "-m",
            "src.train",
            "parallel=ddp",
            *small_run(tmp_path, store, shared_data, "epochs=1", f"hydra.run.dir={outputs}"),
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    assert (outputs / "metrics.json").exists() and not (ROOT / ".hydra").exists()


@pytest.mark.slow
def test_submitit_local_sweep_runs_two_jobs(tmp_path, store, shared_data):
    result = run_cli(
        "-m",
        "hydra/launcher=submitit_local",
        "amp=true,false",
        *small_run(tmp_path, store, shared_data, "epochs=1", "limit_batches=2"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = children(store)
    assert len(jobs) == 2 and {r.info.status for r in jobs} == {"FINISHED"}
    assert (tmp_path / "sweep" / ".submitit").is_dir()


@pytest.mark.slow
def test_submitit_tasks_form_one_ddp_job(tmp_path, store, shared_data):
    """The SLURM code path, run by submitit's local executor: 2 tasks of one job join one process group."""
    result = run_cli(
        "-m",
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        "parallel=ddp",
        *small_run(tmp_path, store, shared_data, "epochs=1", "limit_batches=2"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (job,) = children(store)
    assert job.info.status == "FINISHED" and job.data.params["world_size"] == "2"
    assert all(len(values) == 1 for values in history(store, job.info.run_id).values())


@pytest.mark.parametrize(
    "environment,error",
    [
        ({}, "RANK=0 and WORLD_SIZE=2 in the environment without MASTER_ADDR and MASTER_PORT, where the ranks meet"),
        ({"MASTER_ADDR": "127.0.0.1"}, "RANK=0 and WORLD_SIZE=2 in the environment without MASTER_PORT, where"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 in the environment is no TCP port"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "port"}, "MASTER_PORT=port in the environment must be a whole number"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "{free}"}, None),
        (
            {"MASTER_ADDR": "h", "MASTER_PORT": "{taken}"},
            "MASTER_PORT={taken} in the environment cannot be served here",
        ),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "{taken}", "RANK": "1"}, None),  # rank 0 serves the store
        ({"MASTER_ADDR": "h", "MASTER_PORT": "{taken}", "TORCHELASTIC_USE_AGENT_STORE": "True"}, None),  # torchrun
    ],
)
def test_a_rank_set_by_hand_needs_where_the_ranks_meet(monkeypatch, environment, error):
    """torch's env:// rendezvous failed with a traceback, after the run was created ({taken}: a port a process
    listens on, {free}: one none does)."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "SUBMITIT_EXECUTOR", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    with socket.create_server(("", 0)) as listening:
        taken = str(listening.getsockname()[1])
        environment = {"RANK": "0", "WORLD_SIZE": "2", **environment}
        for name, value in environment.items():
            monkeypatch.setenv(name, value.replace("{taken}", taken).replace("{free}", str(free_port())))
        if error is None:
            assert dist.external_rank() == dist.Rank(int(environment["RANK"]), 2, 0)
            return
        with pytest.raises(UsageError, match=f"^{re.escape(error.replace('{taken}', taken))}"):
            dist.external_rank()
