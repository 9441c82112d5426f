"""src/perf/autobatch.py: ``batch_size=auto`` fitted to the memory budget at the effective batch, given and derived
batches checked against memory and BatchNorm's one-sample maps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from src.data.files import split_sizes
from src.errors import UsageError
from src.execution import resolve
from src.perf import autobatch
from src.perf.autobatch import (
    CPU_HEADROOM,
    check_fits,
    check_one_sample,
    derived_batch,
    predicted_batch,
    predicted_candidates,
    usable_mb,
)
from src.perf.memory import predict
from tests.helpers import compose_config, on_cpu, run_cli, runs, small_run

CPU = torch.device("cpu")


def test_auto_keeps_the_prediction_at_the_accumulation_the_run_trains_with(shared_data):
    """effective_batch_size=64: batch 16 trains at accumulate 4, whose accumulated step the predictor puts ~26 MiB above
    accumulate 1's (resnet18 28^3: 590 vs 564 MiB). A usable budget between the two must not pick 16."""
    cfg = OmegaConf.to_object(
        compose_config(
            "model=resnet18",
            "batch_size=auto",
            "effective_batch_size=64",
            "mem_budget_mb=680",
            "epochs=1",
            "num_threads=2",
            f"data.root={shared_data}",
        )
    )
    chosen = predicted_batch(cfg, on_cpu(cfg), 1)
    assert chosen.batch_size * chosen.accumulate == 64
    assert predict(chosen, on_cpu(cfg)).total_mb <= usable_mb(680, CPU)


@pytest.mark.slow
def test_auto_batch_fits_the_budget_and_keeps_the_effective_batch(tmp_path, store, shared_data):
    overrides = small_run(
        tmp_path,
        store,
        shared_data,
        "model.stem=small",
        "batch_size=auto",
        "effective_batch_size=8",
        "epochs=1",
        "limit_batches=2",
    )
    cfg = OmegaConf.to_object(compose_config(*[o for o in overrides if not o.startswith("hydra.")]))
    budget = predict(cfg, on_cpu(cfg), 4).total_mb / (1 - CPU_HEADROOM) + 1  # room for 4 per step, not for 8
    result = run_cli(*overrides, f"mem_budget_mb={budget}")
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    batch, accumulate = int(run.data.params["batch_size"]), int(run.data.params["accumulate"])
    assert batch in (2, 4) and batch * accumulate == 8 and run.data.params["effective_batch_size"] == "8"
    usable = float(run.data.tags["batch.auto_usable_mb"])
    assert usable == pytest.approx(budget * (1 - CPU_HEADROOM), abs=0.5)
    assert run.data.tags["batch.auto"] == "true" and float(run.data.tags["batch.auto_predicted_mb"]) <= usable + 0.5
    assert run.data.metrics["mem/peak_mb"] <= budget, (run.data.tags, run.data.params["batch_size"], budget)


def test_auto_batch_keeps_the_headroom_free_on_cpu_only(tmp_path, store, shared_data):
    overrides = small_run(tmp_path, store, shared_data, "model.stem=small", "batch_size=auto", "effective_batch_size=8")
    cfg = OmegaConf.to_object(compose_config(*[o for o in overrides if not o.startswith("hydra.")]))
    execution = on_cpu(cfg)
    at_4 = predict(dataclasses.replace(cfg, batch_size=4, accumulate=2), execution, 4).total_mb  # trains 8 as 4 x 2
    for budget, batches in [(at_4 + 1, [2]), (at_4 / (1 - CPU_HEADROOM) + 1, [4, 2])]:  # BatchNorm: 2 or more
        assert predicted_candidates(dataclasses.replace(cfg, mem_budget_mb=budget), execution, 1) == (budget, batches)
    assert usable_mb(1000.0, CPU) == 1000.0 * (1 - CPU_HEADROOM) and usable_mb(1000.0, torch.device("cuda")) == 1000.0


def test_auto_batch_with_accumulate_keeps_each_optimizer_step_within_the_training_split(shared_data):
    """With ``accumulate=2`` and no effective batch, a micro-batch of the whole split made a step past it, refused
    after the probes."""
    cfg = OmegaConf.to_object(
        compose_config("model=resnet10", "batch_size=auto", "accumulate=2", f"data.root={shared_data}")
    )
    train = split_sizes(cfg.data)["train"]
    _, batches = predicted_candidates(dataclasses.replace(cfg, mem_budget_mb=1e9), on_cpu(cfg), 1)
    assert batches[0] == train // 2 and all(batch * 2 <= train for batch in batches)


def test_no_batch_fitting_names_the_budget_as_given(shared_data):
    """A fractional ``mem_budget_mb`` printed as given (``0.5`` was ``0``)."""
    cfg = OmegaConf.to_object(compose_config("model=resnet10", "batch_size=auto", f"data.root={shared_data}"))
    with pytest.raises(UsageError, match=r"^batch_size=auto: no micro-batch fits mem_budget_mb=0.5: raise"):
        predicted_batch(dataclasses.replace(cfg, mem_budget_mb=0.5), on_cpu(cfg), 1)


def test_a_given_batch_past_the_memory_free_is_refused_on_cpu_and_past_a_gpus_budget(shared_data, monkeypatch):
    """Past it the kernel kills the job mid-run (its run left RUNNING); a GPU's out of memory is the job's to take,
    except past ``mem_budget_mb``, where its allocator is capped (predicted on fake tensors: no GPU needed)."""
    cfg = OmegaConf.to_object(compose_config("model=resnet10", "batch_size=4", f"data.root={shared_data}"))
    execution = on_cpu(cfg)
    check_fits(cfg, execution)
    with pytest.raises(
        UsageError, match=r"^batch_size=4: the memory predictor puts this job's peak at 1000000 ranks x "
    ):
        check_fits(cfg, dataclasses.replace(execution, ranks_on_node=1_000_000))  # past any machine
    with pytest.raises(UsageError, match=r"GiB, more than mem_budget_mb=1 less 15% \(CPU peaks .*\): lower batch_size"):
        check_fits(dataclasses.replace(cfg, mem_budget_mb=1), execution)
    # a GPU's replay needs CUDA: the same config's CPU prediction stands in for it
    monkeypatch.setattr(autobatch, "predicted", lambda cfg, _, cached=True: predict(cfg, execution))
    gpu = execution.on(torch.device("cuda"))
    check_fits(cfg, gpu)  # no budget: the job's to take
    with pytest.raises(UsageError, match=r"GiB, more than mem_budget_mb=1 \(the GPU's allocator is capped"):
        check_fits(dataclasses.replace(cfg, mem_budget_mb=1), gpu)
    check_fits(dataclasses.replace(cfg, mem_budget_mb=10**6), dataclasses.replace(gpu, ranks_on_node=1_000_000))


@pytest.mark.parametrize(
    "overrides,refused",
    [
        (["batch_size=1"], True),
        (["batch_size=1", "data.size=64"], False),
        (["batch_size=1", "model.norm=group"], False),
    ],
)
def test_one_sample_on_batchnorms_1_cubed_map_is_refused(shared_data, overrides, refused):
    cfg = OmegaConf.to_object(compose_config("model=resnet10", f"data.root={shared_data}", *overrides))
    if not refused:
        check_one_sample(cfg)
        return
    with pytest.raises(UsageError, match=r"^batch_size=1: model=resnet10 at data.size=28 reaches a 1\^3 map, where"):
        check_one_sample(cfg)


def test_a_derived_batch_that_does_not_divide_names_the_fix():
    cfg = OmegaConf.to_object(compose_config("batch_size=derived", "effective_batch_size=30", "accumulate=4"))
    with pytest.raises(
        UsageError,
        match=r"effective_batch_size=30 is not a multiple of accumulate x ranks = 4 x 1: "
        r"use a multiple of 4",
    ):
        derived_batch(cfg, world=1)
    with pytest.raises(
        ValueError,
        match=r"^batch_size=derived needs effective_batch_size=<n>: "
        r"batch_size is effective_batch_size / \(accumulate x ranks\)$",
    ):
        OmegaConf.to_object(compose_config("batch_size=derived"))


@pytest.mark.gpu
def test_a_gpu_budget_caps_the_allocator_and_an_allocation_past_it_is_a_real_out_of_memory(shared_data):
    cfg = OmegaConf.to_object(compose_config("device=cuda", "mem_budget_mb=256", f"data.root={shared_data}"))
    cuda = torch.device("cuda", torch.cuda.current_device())
    autobatch.cap_to_budget(cfg, cuda)
    try:
        torch.empty(64 * 2**20, device=cuda)  # 256 MiB: the budget's whole
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(512 * 2**20, device=cuda)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, cuda)
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_a_gpu_budget_shrinks_auto_and_refuses_a_given_batch_predicted_past_it(shared_data):
    cfg = OmegaConf.to_object(
        compose_config("model=resnet18", "device=cuda", "batch_size=auto", f"data.root={shared_data}")
    )
    execution = resolve(cfg)
    roomy = predicted_batch(dataclasses.replace(cfg, mem_budget_mb=8000), execution, 1).batch_size
    tight = predicted_batch(dataclasses.replace(cfg, mem_budget_mb=600), execution, 1).batch_size
    assert tight < roomy
    given = dataclasses.replace(cfg, batch_size=roomy, mem_budget_mb=600)
    with pytest.raises(UsageError, match=r"more than mem_budget_mb=600 \(the GPU's allocator is capped there\)"):
        check_fits(given, execution)
