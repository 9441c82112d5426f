"""src/parallel/dist.py: ranks and where they meet: the rendezvous store's port, GPU slots, ranks set by torchrun,
submitit or by hand, each node's system metrics."""

from __future__ import annotations

import re
import shutil
import socket
from datetime import timedelta

import pytest
import torch

from src.errors import UsageError
from src.parallel import dist
from src.parallel.dist import Rank
from tests.helpers import ROOT, children, free_port, history, run_cli, run_process, runs, small_run


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


@pytest.mark.parametrize(
    "env,rank,expected",
    [
        ({}, Rank(1, 2, 1), None),  # ranks spawned by the job: one node
        ({"LOCAL_WORLD_SIZE": "2"}, Rank(2, 2, 0), None),  # torchrun on one node
        ({"LOCAL_WORLD_SIZE": "2"}, Rank(2, 4, 0), "node1"),  # the second of two nodes
        ({"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}, Rank(3, 4, 1), "node1"),  # torchrun says which node
    ],
)
def test_each_node_of_a_multi_node_job_logs_its_system_metrics_apart(monkeypatch, env, rank, expected):
    for key in ("LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert rank.node == expected
