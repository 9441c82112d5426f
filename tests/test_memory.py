"""``python -m src.memory``: a run's predicted peak memory part by part, printed by a real process."""

from __future__ import annotations

from tests.helpers import run_cli
from tests.perf.helpers import predict, typed


def test_cli_prints_the_breakdown():
    result = run_cli("model=resnet18", "model.stem=standard", "data=synthetic", "batch_size=4", module="src.memory")
    assert result.returncode == 0, result.stderr
    expected = predict(typed())
    assert result.stdout.splitlines()[-1].split() == ["total", f"{expected.total_mb:.1f}"]
    assert "params" in result.stdout and "in the CPU baseline: not counted" in result.stdout


def test_cli_refuses_float16_on_cpu():
    result = run_cli("amp=true", "amp_dtype=float16", "device=cpu", module="src.memory")
    assert result.returncode == 2
    assert result.stderr.startswith("error: amp_dtype=float16 needs a CUDA device")
