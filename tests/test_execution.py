"""A job's execution, resolved once (:mod:`src.execution`): the compute dtype, CUDA graphs, the DDP backend, threads;
read by the trainer, the memory predictor and the dry run as it was resolved, and decided nowhere else."""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from src.errors import UsageError
from src.execution import amp_dtype, compute_dtype, cpu_has_fast_bf16, cuda_graphs, fusing, resolve
from src.jobs import dry_run
from src.jobs.plan import plan_job
from src.perf import memory, memory_cache
from src.perf.step_timing import StepTime
from tests.helpers import ROOT, compose_config, hydra_job, on_cpu, run_cli, runs, small_run

CUDA = torch.device("cuda")  # only named: the decisions below read no CUDA state for these configs
CPU = torch.device("cpu")
DECISIONS = {
    "amp_dtype",
    "compute_dtype",
    "cuda_graphs",
    "graph_blocker",
    "ddp_backend",
    "thread_count",
    "fusing",
    "fuse_blocker",
}
MACHINE = {"_is_avx512_bf16_supported", "_is_amx_tile_supported", "is_bf16_supported"}


def config(*overrides: str):
    return OmegaConf.to_object(compose_config(*overrides))


def graphs(cfg, device: torch.device) -> tuple[bool, str]:
    return cuda_graphs(cfg, device, compute_dtype(cfg, device)[0])


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads Linux's CPU flags")
def test_native_bf16_is_the_cpus_own_flags_not_onednns_support():
    """oneDNN calls bf16 supported on any AVX-512 CPU, where it emulates it (0.33-0.44x float32 on a Xeon without
    avx512_bf16): ``amp=true`` trained slower there."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    assert cpu_has_fast_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})


def test_amp_dtype_resolution():
    cfg = config()
    assert amp_dtype(cfg, CPU) is (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
    assert amp_dtype(config("amp_dtype=bfloat16"), CPU) is torch.bfloat16
    assert amp_dtype(cfg, CUDA) is torch.float16
    with pytest.raises(UsageError, match="amp_dtype=float16 needs a CUDA device .*use amp_dtype=bfloat16 or auto"):
        amp_dtype(config("amp_dtype=float16"), CPU)


def test_the_compute_dtype_says_why():
    assert compute_dtype(config("amp=false", "amp_dtype=bfloat16"), CPU) == (torch.float32, "amp=false")
    assert compute_dtype(config("amp=true", "amp_dtype=bfloat16"), CPU)[0] is torch.bfloat16
    dtype, why = compute_dtype(config("amp=true"), CPU)
    assert dtype is (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
    assert why.startswith("amp=true: this CPU has no native bf16") == (dtype is torch.float32)


@pytest.mark.parametrize(
    "overrides,because",
    [
        ((), None),
        (("amp=true", "amp_dtype=bfloat16", "ema_decay=0.99", "grad_clip=1", "accumulate=2", "sched=cyclic"), None),
        (("compile=true",), "compile=true"),
        (("parallel=ddp",), "parallel=ddp"),
        (("parallel=dp",), "parallel=dp"),
        (("amp=true", "amp_dtype=float16"), "float16 autocast"),
        (("optim=sgd",), "optim=sgd"),
        (("model.checkpointing=true",), "model.checkpointing"),
    ],
)
def test_auto_graphs_a_cuda_step_unless_something_in_it_cannot_be_captured(overrides, because):
    graphed, why = graphs(config(*overrides), CUDA)
    assert graphed == (because is None) and why.startswith(because or "")
    if because is not None:
        with pytest.raises(UsageError, match=f"^cuda_graphs=true cannot run here: {because}.*; use cuda_graphs=auto"):
            graphs(config(*overrides, "cuda_graphs=true"), CUDA)
    assert graphs(config(*overrides, "cuda_graphs=false"), CUDA) == (False, "cuda_graphs=false")


def test_on_the_cpu_auto_steps_eagerly_and_true_is_refused():
    assert graphs(config(), CPU) == (False, "CUDA graphs need a CUDA device (this run is on cpu)")
    with pytest.raises(UsageError, match="^cuda_graphs=true cannot run here: CUDA graphs need a CUDA device"):
        graphs(config("cuda_graphs=true"), CPU)


@pytest.mark.parametrize(
    "overrides,because",
    [
        ((), None),
        (("seed=3", "optim.lr=0.1", "ema_decay=0.9", "aug=standard", "label_smoothing=0.1", "sched=cyclic"), None),
        (("parallel=ddp",), "parallel=ddp or dp"),
        (("parallel=dp",), "parallel=ddp or dp"),
        (("compile=true",), "compile=true"),
        (("model.checkpointing=true",), "model.checkpointing"),
        (("channels_last=true",), "channels_last"),
        (("oom_retry=true",), "oom_retry"),
        (("batch_size=auto",), "batch_size=auto"),
        (("mem_budget_mb=24576",), "mem_budget_mb"),
        (("fault.term_step=2",), "fault.*"),
    ],
)
def test_auto_fuses_on_cuda_unless_the_step_cannot_be_stacked_and_true_is_refused_there(overrides, because):
    fused, why = fusing(config(*overrides), CUDA)
    assert fused == (because is None) and why.startswith(because or "")
    if because is not None:
        with pytest.raises(UsageError, match=f"^fuse=true cannot run here: {because}.*; use fuse=auto or false$"):
            fusing(config(*overrides, "fuse=true"), CUDA)
    assert fusing(config(*overrides, "fuse=false"), CUDA) == (False, "fuse=false")


def test_on_the_cpu_auto_keeps_jobs_apart_and_says_why_true_fuses_there():
    fused, why = fusing(config(), CPU)
    assert not fused and why.startswith("fuse=auto fuses on CUDA only")
    assert fusing(config("fuse=true"), CPU) == (True, "")
    execution = on_cpu(config("fuse=true"))
    assert execution.fuse and execution.tags()["fuse"] == "true" and "fuse.alone_because" not in execution.tags()
    alone = execution.alone("no other job of the sweep")
    assert alone.tags()["fuse"] == "false" and alone.tags()["fuse.alone_because"] == "no other job of the sweep"
    assert on_cpu(config()).tags()["fuse.alone_because"] == why


def test_an_execution_is_what_its_run_is_tagged_with_and_travels_to_spawned_ranks():
    execution = on_cpu(config("num_threads=3", "amp=false", "channels_last=true", "parallel=ddp", "parallel.nproc=2"))
    assert execution.tags() == {
        "amp.dtype": "float32",
        "device": "cpu",
        "num_threads": "3",
        "cuda_graphs": "false",
        "cuda_graphs.eager_because": "CUDA graphs need a CUDA device (this run is on cpu)",
        "fuse": "false",
        "fuse.alone_because": "parallel=ddp or dp (a fused group trains in one process on one device)",
    }
    assert execution.backend == "gloo" and execution.ranks_on_node == 2
    assert execution.autocast is None and execution.memory_format is torch.channels_last_3d
    assert pickle.loads(pickle.dumps(execution)) == execution
    assert on_cpu(config()).backend is None


def test_a_plan_resolves_its_execution_once_with_the_resumed_runs_threads(tmp_path, monkeypatch, shared_data):
    """The plan holds the execution; the threads of a run it resumes win over this machine's count."""
    calls = []
    monkeypatch.setattr("src.execution.resolve", lambda *args: calls.append(args) or resolve(*args))
    overrides = ["device=cpu", f"data.root={shared_data}", "model=resnet10", "skip_finished=false"]
    plan = plan_job(compose_config(*overrides), hydra_job(tmp_path / "job", overrides))
    assert len(calls) == 1 and plan.execution == resolve(plan.cfg)
    assert resolve(plan.cfg, resumed_threads=5).threads == 5
    assert resolve(dataclasses.replace(plan.cfg, num_threads=2), resumed_threads=5).threads == 2


def test_the_predictor_predicts_the_step_the_execution_runs(tmp_path, monkeypatch):
    """A graphed step holds its static batches and the graph's terms; the cache keeps the two predictions apart. (A
    real graphed step needs CUDA: its figures are in the ``gpu`` tests.)"""
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))
    cfg = config("data=synthetic", "model=resnet10", "batch_size=4", "accumulate=2")
    eager = on_cpu(cfg)
    graphed = dataclasses.replace(eager, graphed=True, eager_because="")
    plain, captured = memory.predict(cfg, eager), memory.predict(cfg, graphed)
    assert (plain.step, captured.step) == ("eager", "graphed") and "graphed step" in captured.table()
    assert plain.static_inputs_mb == 0 and captured.static_inputs_mb == 2 * 4 * (4 * 28**3 + 8) / memory.MIB
    graphed_terms = ("static_inputs_mb", *memory.GRAPHED)
    assert all(getattr(plain, term) == 0 < getattr(captured, term) for term in graphed_terms)
    added = sum(getattr(captured, term) for term in graphed_terms)
    assert captured.total_mb == pytest.approx(plain.total_mb + added)
    assert memory_cache.predicted(cfg, eager) == plain and memory_cache.predicted(cfg, graphed) == captured


def test_the_dry_run_times_the_step_the_execution_runs(tmp_path, monkeypatch, store, shared_data):
    """A graphed job's step is timed as its own shape (its timing is not an eager one's), and its line says so."""
    shapes = []

    def timed(shape, device, threads, prepare):
        shapes.append((shape, threads))
        return StepTime(0.1, 0.05, 5, 0.0, False)

    monkeypatch.setattr(dry_run, "step_time", timed)
    overrides = ["device=cpu", f"data.root={shared_data}", "model=resnet10", f"mlflow.tracking_uri={store}"]
    plan = plan_job(compose_config(*overrides), hydra_job(tmp_path / "job", overrides))
    graphed = dataclasses.replace(plan, execution=dataclasses.replace(plan.execution, graphed=True, threads=7))
    for each in (plan, graphed):
        dry_run.training_rate(each, each.cfg, (), 1)
    (eager_shape, eager_threads), (graphed_shape, graphed_threads) = shapes
    assert "step" not in eager_shape and graphed_shape == {**eager_shape, "step": "graphed"}
    assert (eager_threads, graphed_threads) == (plan.execution.threads, 7)
    line = dry_run.JobEstimate(0, "x", "run", 4, 100.0, 1.0, "~1 min", "graphed").line()
    assert "peak 100 MiB at batch 4, graphed |" in line


def test_no_module_but_execution_decides_how_a_run_executes():
    """The decisions and the machine facts they read are called in src/execution.py only."""
    for path in (ROOT / "src").rglob("*.py"):
        if path.name == "execution.py" and path.parent.name == "src":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                assert name not in DECISIONS | MACHINE, f"{path.relative_to(ROOT)}:{node.lineno} calls {name}"


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
