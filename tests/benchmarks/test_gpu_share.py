"""benchmarks/gpu_share.py: jobs sharing one GPU: its argument checks, its table on the CPU (its figures mean something
on a CUDA machine only)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import gpu_share
from tests.helpers import run_process


@pytest.mark.parametrize("argv", [["--jobs", "1,x"], ["--jobs", "0"], ["--device", "cuda", "--warmup", "1"]])
def test_gpu_share_refuses_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_share.parse_args(argv)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_share_on_the_cpu_sums_the_processes_per_round(tmp_path):
    tiny = "--device cpu --model resnet10 --batch 2 --steps 1 --warmup 0 --rounds 2 --jobs 1,2 --mps auto"
    result = run_process([sys.executable, "-m", "benchmarks.gpu_share", *tiny.split(), "--json", str(tmp_path / "j")])
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| jobs at once | MPS | samples/s summed")
    assert rows[1].startswith("| 1 | no | ") and rows[1].endswith("| **1.00x** (1.00-1.00) |")
    assert rows[2].startswith("| 2 | no | ")  # the CPU: no MPS
    (figures,) = [json.loads(line) for line in (tmp_path / "j").read_text().splitlines()]
    assert [row["jobs"] for row in figures["rows"]] == [1, 2]
    assert all(len(row["summed_per_round"]) == 2 and min(row["summed_per_round"]) > 0 for row in figures["rows"])
