"""Out-of-memory tolerance (real torch.OutOfMemoryError by fault injection), batch auto-fit, FLOPs, MFU, switches."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from src.data import split_sizes
from src.errors import UsageError
from src.jobs.outcome import attempts, closed_failed
from src.models.profile import forward_flops, train_flops
from src.perf.autobatch import (
    CPU_HEADROOM,
    check_fits,
    check_one_sample,
    predicted_batch,
    predicted_candidates,
    usable_mb,
)
from src.perf.memory import predict
from src.perf.probe_cache import ProbeCache, age
from src.tracking.runs import RunLogger
from src.tracking.store import ensure_store
from src.training.meters import KNOWN_PEAKS, PEAK_MAX_AGE, cached_peaks, peak_cache_file, peak_flops, peak_key
from src.training.mfu import Mfu
from tests.helpers import compose_config, run_cli, runs, small_run

CPU = torch.device("cpu")


def children(store):
    return [r for r in runs(store) if r.data.tags.get("mlflow.parentRunId")]


@pytest.mark.slow
def test_an_oom_job_is_tagged_and_the_sweep_goes_on(tmp_path, store, shared_data):
    result = run_cli(
        "-m",
        *small_run(
            tmp_path, store, shared_data, "epochs=1", "fault.oom_step=1", "fault.oom_min_batch=8", "batch_size=4,8"
        ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    by_batch = {r.data.params["batch_size"]: r for r in children(store)}
    assert by_batch["4"].info.status == "FINISHED"
    oom = by_batch["8"]
    assert oom.info.status == "FAILED" and oom.data.tags["status"] == "oom" and oom.data.tags["retried"] == "false"
    assert oom.data.metrics["mem/peak_mb"] > 0
    parent = next(r for r in runs(store) if r.data.tags.get("role") == "sweep")
    assert parent.info.status == "FAILED"  # a job of the sweep failed


@pytest.mark.slow
def test_oom_retry_halves_the_micro_batch_and_keeps_the_effective_batch(tmp_path, store, shared_data):
    result = run_cli(
        "-m",
        *small_run(
            tmp_path,
            store,
            shared_data,
            "epochs=1",
            "batch_size=8",
            "accumulate=1",
            "oom_retry=true",
            "fault.oom_step=1",
            "fault.oom_min_batch=8",
        ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (first,) = [r for r in children(store) if r.data.tags.get("status") == "oom"]
    (retry,) = [r for r in children(store) if r.info.status == "FINISHED"]
    assert first.data.tags["retried"] == "true" and retry.data.tags["retry_of"] == first.info.run_id
    assert (retry.data.params["batch_size"], retry.data.params["accumulate"]) == ("4", "2")
    assert first.data.params["effective_batch_size"] == retry.data.params["effective_batch_size"] == "8"
    parent = next(r for r in runs(store) if r.data.tags.get("role") == "sweep")
    assert parent.info.status == "FINISHED"  # the job's last attempt succeeded


@pytest.mark.parametrize(
    "overrides,batches", [([], [8, 4, 2]), (["data.size=64"], [8, 4, 2, 1]), (["model.norm=group"], [8, 4, 2, 1])]
)
def test_oom_retries_stop_before_one_sample_batchnorm_cannot_train_on(shared_data, overrides, batches):
    cfg = OmegaConf.to_object(
        compose_config("model=resnet10", "batch_size=8", "oom_retry=true", f"data.root={shared_data}", *overrides)
    )
    assert [(c.batch_size, c.accumulate) for c in attempts(cfg)] == [(b, 8 // b) for b in batches]


@pytest.mark.parametrize(
    "overrides,retried", [(["batch_size=2"], False), (["batch_size=2", "data.size=64"], True), (["batch_size=4"], True)]
)
def test_an_oom_retry_is_announced_only_where_attempts_makes_one(tmp_path, store, shared_data, overrides, retried):
    """resnet10 at 28^3, batch 2: attempts() stops (one sample on BatchNorm's 1^3 map), so the failed run must not say
    it is retried: the job's loop would end with no attempt left and close the FAILED run FINISHED."""
    cfg = OmegaConf.to_object(
        compose_config("model=resnet10", "oom_retry=true", "epochs=1", f"data.root={shared_data}", *overrides)
    )
    (tmp_path / "oom_rank0.json").write_text(json.dumps({"mem/peak_mb": 123.0}))
    plan = type("P", (), {"output_dir": tmp_path, "device": CPU, "multirun": True})()
    client = ensure_store(store)
    run = RunLogger(client, client.create_run(client.create_experiment("oom")).info.run_id)
    assert closed_failed(run, cfg, plan, torch.OutOfMemoryError("injected")) is retried
    logged = client.get_run(run.run_id)
    assert logged.data.tags["retried"] == str(retried).lower() and logged.info.status == "FAILED"
    assert (len(list(attempts(cfg))) > 1) is retried


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
    chosen = predicted_batch(cfg, CPU, 1)
    assert chosen.batch_size * chosen.accumulate == 64
    assert predict(chosen, CPU).total_mb <= usable_mb(680, CPU)


@pytest.mark.slow
def test_oom_in_a_single_run_is_one_clear_line(tmp_path, store, shared_data):
    result = run_cli(*small_run(tmp_path, store, shared_data, "fault.oom_step=1"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: out of memory at batch_size=4 (peak ")
    (run,) = runs(store)
    assert run.info.status == "FAILED" and run.data.tags["status"] == "oom"


def plant_peak(folder: Path, flops: float, at: datetime.datetime, threads: int | None = None) -> str:
    """A peak cache in ``folder`` holding ``flops`` for this CPU in float32, probed ``at``; returns its key."""
    key = peak_key(CPU, torch.float32, threads)
    entry = {"flops": flops, "source": "probe", "at": at.isoformat()}
    (folder / "peak_flops.json").write_text(json.dumps({key: entry}))
    return key


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)


@pytest.mark.slow
def test_runs_log_mfu_at_most_1_even_against_a_planted_low_peak(tmp_path, store, shared_data, monkeypatch):
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))  # inherited by the job's process
    started = now()
    key = plant_peak(tmp_path, 1e6, started, threads=1)  # fresh, so only an epoch above it probes again
    result = run_cli(*small_run(tmp_path, store, shared_data, "epochs=1"))
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    metrics, tags = run.data.metrics, run.data.tags
    assert 0 < metrics["perf/mfu"] <= 1
    assert metrics["perf/tflops"] == pytest.approx(
        metrics["perf/mfu"] * float(tags["perf.peak_tflops_per_device"]), rel=1e-3
    )
    cached = cached_peaks()[key]
    assert cached.flops > 1e6 and tags["perf.peak_source"] == cached.source in ("probe", "measured")
    assert float(tags["perf.peak_tflops_per_device"]) == pytest.approx(cached.flops / 1e12, rel=1e-5)
    assert datetime.datetime.fromisoformat(tags["perf.peak_updated_at"]) == cached.at >= started
    assert tags["perf.peak_age_days"] == "0.0"


def test_an_epoch_above_the_cached_peak_raises_it_so_mfu_stays_at_most_1(tmp_path, monkeypatch):
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))
    key = plant_peak(tmp_path, 1e6, now())
    mfu = Mfu(1e9, peak_flops(CPU, torch.float32), 1, CPU, torch.float32)
    assert mfu.peak.flops == 1e6  # fresh: taken from the cache, not probed
    heard = []
    mfu.on_new_peak = heard.append
    metrics = mfu({"perf/samples_per_s": 0.1})  # 1e8 FLOP/s: above the planted peak, below any real probe
    assert mfu.peak.source == "probe" and mfu.peak.flops > 1e9 and heard == [mfu.peak]
    assert metrics == {"perf/tflops": pytest.approx(1e-4), "perf/mfu": pytest.approx(1e8 / mfu.peak.flops)}
    assert cached_peaks()[key] == mfu.peak  # the low probe is gone from the cache
    # a rate above even a fresh probe (the matmul probe is not a perfect peak) becomes the peak
    assert mfu({"perf/samples_per_s": 1e6}) == {"perf/tflops": 1e3, "perf/mfu": 1.0}
    assert (mfu.peak.flops, mfu.peak.source) == (1e15, "measured") and cached_peaks()[key] == mfu.peak == heard[-1]
    assert mfu.tags()["perf.peak_source"] == "measured" and mfu.tags()["perf.peak_tflops_per_device"] == "1000"


@pytest.mark.parametrize(("planted", "kept"), [(1e6, False), (1e18, True)])
def test_a_stale_probe_is_taken_again_and_the_best_one_kept(tmp_path, monkeypatch, planted, kept):
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))
    key = plant_peak(tmp_path, planted, now() - PEAK_MAX_AGE - datetime.timedelta(days=1))
    peak = peak_flops(CPU, torch.float32)
    assert (peak.flops == planted) == kept and peak.flops > 1e9 and peak.source == "probe"
    assert peak.age() < datetime.timedelta(hours=1) and cached_peaks()[key] == peak  # probed now: fresh again


def test_the_peak_cache_is_in_the_tests_own_folder_or_where_the_environment_says(tmp_path, monkeypatch, cache_dir):
    assert peak_cache_file() == cache_dir / "peak_flops.json"  # tests/conftest.py: never the user's home cache
    monkeypatch.delenv("MEDSWEEP_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert peak_cache_file() == tmp_path / "xdg" / "medsweep" / "peak_flops.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert peak_cache_file() == tmp_path / "home" / ".cache" / "medsweep" / "peak_flops.json"


DAMAGED = {  # what a cache file may hold after a hand, another tool or a failing disk: each is probed again
    "random bytes": b"\x9d\xff\x00garbage",
    "JSON cut short": b'{"a": {"at": "2026-11-27T10:00:00+00:00", ',
    "not an object": b"[1, 2]",
    "entries of another shape": b'{"a": 5, "b": {"at": "yesterday"}, "c": {"at": "2026-11-27T10:00:00"}, "d": {}}',
}


@pytest.mark.parametrize("content", DAMAGED.values(), ids=DAMAGED)
def test_a_damaged_cache_file_is_probed_again_and_written_anew(tmp_path, monkeypatch, content):
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))
    peak_cache_file().write_bytes(content)
    assert cached_peaks() == {}
    first = peak_flops(CPU, torch.float32)
    assert first.source == "probe" and cached_peaks() == {peak_key(CPU, torch.float32): first}
    cache = ProbeCache("probes.json", fresh=lambda entry: age(entry) < datetime.timedelta(days=1), fields=("value",))
    cache.path.write_bytes(content)
    assert cache.get("a") is None and cache.get("c") is None
    cache.put("a", {"value": 1})
    assert cache.get("a")["value"] == 1 and list(cache.entries()) == ["a"]


def test_weight_gradient_flops_of_grouped_convs_are_corrected():
    with torch.device("meta"):
        for groups in (1, 4, 16):
            conv = nn.Conv3d(16, 16, 3, padding=1, groups=groups, bias=False)
            x = torch.empty(2, 16, 8, 8, 8, requires_grad=True)
            assert train_flops(conv, x) == 3 * forward_flops(conv, x)  # input grad + weight grad = 2x forward


def test_known_gpus_come_from_the_table_and_cpu_from_a_cached_probe(tmp_path, monkeypatch):
    assert KNOWN_PEAKS["H200"]["bfloat16"] == 989e12
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))
    first = peak_flops(CPU, torch.float32)
    assert first.source == "probe" and first.flops > 1e9 and cached_peaks() == {peak_key(CPU, torch.float32): first}
    assert peak_flops(CPU, torch.float32) == first  # cached, not probed again


@pytest.mark.slow
@pytest.mark.parametrize(
    "switch", ["channels_last=true", "model.inplace_act=false", "non_blocking=false", "data.loader=dataloader"]
)
def test_speed_switches_train_and_are_logged(tmp_path, store, shared_data, switch):
    assert run_cli(*small_run(tmp_path, store, shared_data, "epochs=1", "limit_batches=2", switch)).returncode == 0
    (run,) = runs(store)
    key, value = switch.split("=")
    assert run.info.status == "FINISHED" and run.data.params[key].lower() == value


@pytest.mark.slow
def test_torch_compile_trains(tmp_path, store, shared_data):
    result = run_cli(*small_run(tmp_path, store, shared_data, "epochs=1", "limit_batches=2", "compile=true"))
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.params["compile"] == "True"


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
    budget = predict(cfg, CPU, 4).total_mb / (1 - CPU_HEADROOM) + 1  # room for 4 per step, not for 8
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
    at_4 = predict(dataclasses.replace(cfg, batch_size=4, accumulate=2), CPU, 4).total_mb  # trains 8 as 4 x 2
    for budget, batches in [(at_4 + 1, [2]), (at_4 / (1 - CPU_HEADROOM) + 1, [4, 2])]:  # BatchNorm: 2 or more
        assert predicted_candidates(dataclasses.replace(cfg, mem_budget_mb=budget), CPU, 1) == (budget, batches)
    assert usable_mb(1000.0, CPU) == 1000.0 * (1 - CPU_HEADROOM) and usable_mb(1000.0, torch.device("cuda")) == 1000.0


def test_auto_batch_with_accumulate_keeps_each_optimizer_step_within_the_training_split(shared_data):
    """With ``accumulate=2`` and no effective batch, a micro-batch of the whole split made a step past it, refused
    after the probes."""
    cfg = OmegaConf.to_object(
        compose_config("model=resnet10", "batch_size=auto", "accumulate=2", f"data.root={shared_data}")
    )
    train = split_sizes(cfg.data)["train"]
    _, batches = predicted_candidates(dataclasses.replace(cfg, mem_budget_mb=1e9), CPU, 1)
    assert batches[0] == train // 2 and all(batch * 2 <= train for batch in batches)


def test_no_batch_fitting_names_the_budget_as_given(shared_data):
    """A fractional ``mem_budget_mb`` printed as given (``0.5`` was ``0``)."""
    cfg = OmegaConf.to_object(compose_config("model=resnet10", "batch_size=auto", f"data.root={shared_data}"))
    with pytest.raises(UsageError, match=r"^batch_size=auto: no micro-batch fits mem_budget_mb=0.5: raise"):
        predicted_batch(dataclasses.replace(cfg, mem_budget_mb=0.5), CPU, 1)


def test_a_given_batch_past_the_memory_free_is_refused_on_cpu(shared_data):
    """Past it the kernel kills the job mid-run (its run left RUNNING); a GPU's out of memory is the job's to take."""
    cfg = OmegaConf.to_object(compose_config("model=resnet10", "batch_size=4", f"data.root={shared_data}"))
    check_fits(cfg, CPU, ranks=1)
    with pytest.raises(
        UsageError, match=r"^batch_size=4: the memory predictor puts this job's peak at 1000000 ranks x "
    ):
        check_fits(cfg, CPU, ranks=1_000_000)  # past any machine
    with pytest.raises(UsageError, match=r"GiB, more than mem_budget_mb=1 less 15% \(CPU peaks .*\): lower batch_size"):
        check_fits(dataclasses.replace(cfg, mem_budget_mb=1), CPU, ranks=1)
    check_fits(dataclasses.replace(cfg, mem_budget_mb=1), torch.device("cuda"), ranks=1)  # not a CPU: the job's


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


@pytest.mark.slow
def test_every_run_logs_its_predicted_memory(tmp_path, store, shared_data):
    assert run_cli(*small_run(tmp_path, store, shared_data, "epochs=1")).returncode == 0
    (run,) = runs(store)
    metrics = run.data.metrics
    assert metrics["mem/predict_ratio"] == pytest.approx(metrics["mem/peak_mb"] / metrics["mem/predicted_mb"])
