"""The start-up clock (``time/startup_s``) and the caches of the start-up probes, in a process and on disk."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf

from src.perf import flop_cache, memory_cache, probe_cache, startup
from src.perf.flop_cache import counted_flops
from src.perf.memory import footprint
from src.perf.memory_cache import predicted_memory_metrics
from src.training.mfu import flops_per_sample
from tests.helpers import compose_config, on_cpu, run_process

CPU = torch.device("cpu")


def test_a_fresh_process_counts_from_its_start_and_a_later_job_from_the_previous_end(monkeypatch):
    monkeypatch.setattr(startup, "_previous_job_end", None)
    monkeypatch.setattr(startup, "_entry_imported", None)
    startup.entry_imported()
    imported = startup._entry_imported
    with startup.job_clock() as first:
        hydra = first.phases["hydra"]
        first.imported()  # the job's own imports, once its config is checked: more of the process's imports
        first.mark("config")
    ended = startup._previous_job_end
    with startup.job_clock() as second:
        second.imported()  # loaded already: part of the time between the jobs
        second.mark("config")
    assert list(first.phases) == ["imports", "hydra", "config"] and list(second.phases) == ["between_jobs", "config"]
    assert first.origin == pytest.approx(startup.process_start()) and first.origin < ended
    assert first.phases["imports"] > imported - first.origin and first.phases["hydra"] == hydra
    assert second.origin == ended
    metrics = second.metrics()
    assert metrics["time/startup_s"] == pytest.approx(sum(second.phases.values()))
    assert set(metrics) == {"time/startup_s", "time/startup/between_jobs_s", "time/startup/config_s"}


def test_without_an_entry_module_imports_run_to_the_job(monkeypatch):
    monkeypatch.setattr(startup, "_previous_job_end", None)
    monkeypatch.setattr(startup, "_entry_imported", None)
    clock = startup.StartupClock.begin()
    assert list(clock.phases) == ["imports"] and clock.metrics()["time/startup_s"] == clock.phases["imports"]


def test_the_process_start_precedes_this_test_and_is_stable():
    start = startup.process_start()
    assert start < time.time() and start == pytest.approx(startup.process_start(), abs=0.05)


def test_a_sweeps_later_jobs_reuse_the_probes_of_an_equal_model():
    seed0, seed1, amp = (
        OmegaConf.to_object(compose_config("model=resnet10", "data=synthetic", *extra))
        for extra in (["seed=0"], ["seed=1"], ["seed=0", "amp=true", "amp_dtype=bfloat16"])
    )
    fp32, bf16 = on_cpu(seed0), on_cpu(amp)
    assert footprint(seed0, fp32, 2) is footprint(seed1, fp32, 2)
    assert footprint(seed0, fp32, 2) is not footprint(amp, bf16, 2)
    assert footprint(seed0, fp32, 2) is not footprint(seed0, fp32, 4)
    assert flops_per_sample(seed0) == flops_per_sample(seed1)


def test_the_start_up_probes_are_read_from_disk_by_a_later_process(monkeypatch, tmp_path):
    """A later process (its in-process caches empty) reads the FLOP count and the memory prediction that an earlier
    one wrote; neither the seed, the store a run logs to nor where the data lives changes either. The counting
    functions are replaced by ones that fail, to show that they are not called (the files are real)."""
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))
    seed0, seed1 = (
        OmegaConf.to_object(compose_config("model=resnet10", "data=synthetic", *extra))
        for extra in (["seed=0"], ["seed=1", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'elsewhere.db'}"])
    )
    execution = on_cpu(seed0)
    flops, memory = counted_flops(seed0), predicted_memory_metrics(seed0, execution)({"mem/peak_mb": 100.0})
    assert flops == flops_per_sample(seed0)
    assert len(json.loads((tmp_path / "flops_per_sample.json").read_text())) == 1

    def not_probed(*args):
        raise AssertionError("probed again")

    monkeypatch.setattr(flop_cache, "flops_per_sample", not_probed)
    monkeypatch.setattr(memory_cache, "predict", not_probed)
    assert counted_flops(seed1) == flops
    assert counted_flops(dataclasses.replace(seed1, data=dataclasses.replace(seed1.data, root=str(tmp_path)))) == flops
    assert len(json.loads((tmp_path / "flops_per_sample.json").read_text())) == 1
    assert predicted_memory_metrics(seed1, execution)({"mem/peak_mb": 100.0}) == memory
    assert len(json.loads((tmp_path / "memory_predictions.json").read_text())) == 1
    with pytest.raises(AssertionError, match="probed again"):
        counted_flops(OmegaConf.to_object(compose_config("model=resnet18", "data=synthetic")))


def test_a_gpu_memory_prediction_is_read_back_whatever_the_host_threads(tmp_path, monkeypatch):
    """A job of a 4-job joblib sweep (4 of 16 threads) reads what a lone run on that GPU predicted (all 16); on the
    CPU the threads count (oneDNN's scratch). No GPU here: its name and the replay are stand-ins, the cache is real."""
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(probe_cache, "device_name", lambda device: "NVIDIA H200")
    cfg = OmegaConf.to_object(compose_config("model=resnet10", "data=synthetic"))
    execution = on_cpu(cfg)
    prediction, calls = memory_cache.predict(cfg, execution), []
    monkeypatch.setattr(
        memory_cache, "predict", lambda cfg, execution: calls.append(execution.device.type) or prediction
    )
    for threads in (16, 4):
        for device in (torch.device("cuda"), CPU):
            on_device = dataclasses.replace(execution, device=device, threads=threads)
            assert memory_cache.predicted(cfg, on_device) == prediction
    assert calls == ["cuda", "cpu", "cpu"]


LR = "optim.lr=-1.0 must be >= 0 (0 freezes the weights)"


@pytest.mark.parametrize(
    ("module", "args", "line"),
    [
        ("src.train", ["optim.lr=-1"], LR),
        ("src.train", ["-m", "optim.lr=-1"], f"job 0 (optim.lr=-1): {LR}"),
        ("src.report", ["margin=-0.1"], "margin=-0.1 must be in [0, 1] (an AUC difference)"),
    ],
    ids=["train", "train-multirun", "report"],
)
def test_a_bad_value_is_refused_before_mlflow_and_the_commands_code_are_imported(tmp_path, module, args, line):
    """The one ``error:`` line comes before MLflow and the command's own code load (2026-11-27: 2.5 s less for
    ``src.train``, 3.5 s for ``src.report``)."""
    argv = [module, *args, f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep"]
    loaded = ("mlflow", "src.jobs.plan", "src.jobs.job", "src.report.writer")
    code = f"""
import atexit, runpy, sys
atexit.register(lambda: print(sorted(m for m in {loaded!r} if m in sys.modules)))
sys.argv = {argv!r}
runpy.run_module({module!r}, run_name="__main__")
"""
    result = run_process([sys.executable, "-c", code])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {line}"]
    assert result.stdout.splitlines()[-1] == "[]"


def test_a_jobs_start_up_path_imports_neither_scikit_learn_nor_medmnists_package():
    """Neither the job's modules nor the data's checks load them (~1.5 s, 2026-11-27): a refused config or data file
    is refused without them; the main rank loads them as it starts (``load_libraries``). The data's checks
    read medmnist's INFO from its ``info`` module alone. A fresh process, since this one has imported everything."""
    code = """
import sys
import src.train, src.jobs.rank, src.jobs.reporting, src.training.trainer
from omegaconf import OmegaConf
from src.cli import register
from src.data.files import class_names, ensure_file
from src.data.loaders import load_splits
from tests.helpers import compose_config
register()
data = OmegaConf.to_object(compose_config("data=adrenalmnist3d", "data.download=false")).data
ensure_file(data), load_splits(data), class_names(data)
print(sorted(name for name in ("sklearn", "medmnist", "scipy.stats") if name in sys.modules))
"""
    result = run_process([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"
