"""src/perf/memory_cache.py: each job's predicted memory, cached and logged beside the measured peak."""

from __future__ import annotations

import json

import pytest

from src.execution import validate
from src.perf import memory_cache
from src.perf.autobatch import check_fits
from src.perf.memory import predict
from tests.helpers import compose_config, job_overrides, own_messages, run_cli, runs, small_run


@pytest.mark.slow
def test_every_run_logs_its_predicted_memory(tmp_path, store, shared_data):
    assert run_cli(*small_run(tmp_path, store, shared_data, "epochs=1")).returncode == 0
    (run,) = runs(store)
    metrics = run.data.metrics
    assert metrics["mem/predict_ratio"] == pytest.approx(metrics["mem/peak_mb"] / metrics["mem/predicted_mb"])


def test_a_memory_prediction_is_read_back_from_the_cache(tmp_path, monkeypatch, store, shared_data):
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(memory_cache, "predict", lambda *args: calls.append(args) or predict(*args))
    cfg, execution = validate(compose_config(*job_overrides(tmp_path, store, shared_data)))
    assert memory_cache.predicted(cfg, execution) == memory_cache.predicted(cfg, execution) == predict(cfg, execution)
    assert len(calls) == 1
    (tmp_path / memory_cache.CACHE.name).write_text("not json")  # an unreadable cache is predicted anew
    assert memory_cache.predicted(cfg, execution) == predict(cfg, execution) and len(calls) == 2


def test_a_job_is_not_refused_on_a_figure_the_cache_holds_wrongly(tmp_path, monkeypatch, store, shared_data, caplog):
    """An entry scaled by hand, its parts and total together (it fits the cache's schema), put the job's peak at
    ~231000 GiB: the job was refused as if it needed it. A refusal replays the step first."""
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path / "cache"))
    cfg, execution = validate(compose_config(*job_overrides(tmp_path, store, shared_data)))
    right = memory_cache.predicted(cfg, execution)
    path = memory_cache.CACHE.path
    scaled = {
        key: {name: value * 1e6 if name.endswith("_mb") else value for name, value in entry.items()}
        for key, entry in json.loads(path.read_text()).items()
    }
    path.write_text(json.dumps(scaled))
    assert memory_cache.predicted(cfg, execution).total_mb == pytest.approx(right.total_mb * 1e6)  # read as cached
    check_fits(cfg, execution)  # not refused: replayed
    assert memory_cache.predicted(cfg, execution) == right
    assert own_messages(caplog) == [
        f"{path} held {right.total_mb * 1e6:.1f} MiB for this job, {right.total_mb:.1f} MiB predicted now: its entry "
        "is replaced"
    ]
