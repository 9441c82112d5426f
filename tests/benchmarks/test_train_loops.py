"""benchmarks/train_loops.py: its table on a tiny real setting, its argument checks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from src.training.step_graph import WARMUP_STEPS
from tests.helpers import run_process

GRAPH_WARMUP = WARMUP_STEPS + 1  # the benchmark's: the graphed step's eager steps and the capture


def train_loops(*args: str) -> subprocess.CompletedProcess:
    return run_process([sys.executable, "benchmarks/train_loops.py", *args])


def test_table_has_one_row_per_variant_and_a_ratio(shared_data):
    tiny = "--model resnet10 --size 28 --batch 2 --steps 1 --warmup 1 --repeats 1 --threads 1 --profile 4"
    result = train_loops(*tiny.split(), "--variants", "plain,medsweep", "--data-root", str(shared_data))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "command: python benchmarks/train_loops.py --model resnet10" in out
    assert re.search(r"torch \S+.*; 1 threads; CPU: \S", out)
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    rows, profile = rows[:3], rows[3:]
    assert profile[0] == "| op | plain: calls, self ms | medsweep: calls, self ms |"
    ops = [row.split(" | ")[0] for row in profile[1:]]
    assert ops[0] == "| total" and "| aten::convolution_backward" in ops  # the order of the 4 varies with the load
    assert len(profile) == 6  # header, total and the 4 costliest ops
    conv = profile[1 + ops.index("| aten::convolution_backward")]
    plain_conv, medsweep_conv = conv.strip("| ").split(" | ")[1:]
    assert plain_conv.split(",")[0] == medsweep_conv.split(",")[0]  # the same model: as many conv backwards
    assert rows[0] == ("| variant | model | size | stem | batch | samples/s | step ms | peak MiB | speed-up vs plain |")
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows[1:]]
    assert [c[0] for c in cells] == ["plain", "medsweep"]
    for c in cells:
        assert c[1:5] == ["resnet10 (medsweep zoo)", "28^3", "standard", "2"]
        assert float(c[5]) > 0 and float(c[6]) > 0 and float(c[7]) >= 0
        assert re.fullmatch(r"\*\*\d+\.\d\dx\*\* \(per round \d+\.\d\d, \d+\.\d\d-\d+\.\d\d\)", c[8])
    assert cells[0][8].startswith("**1.00x** ")


def test_monai_densenet_at_28_is_skipped_with_the_reason(shared_data):
    tiny = "--model densenet121 --size 28 --batch 2 --steps 1 --warmup 0 --repeats 1 --threads 1"
    result = train_loops(*tiny.split(), "--variants", "plain,monai", "--data-root", str(shared_data))
    assert result.returncode == 0, result.stderr
    assert "monai: skipped: MONAI's DenseNet121 has only the standard stem and needs 64^3" in result.stdout


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--variants", "plain,tutorial"], "tutorial"),
        (["--variants", "medsweep-graphed"], "unknown on cpu: medsweep-graphed"),
        (["--steps", "0"], "--steps"),
        (["--warmup", "-1"], "--warmup"),
    ],
)
def test_bad_arguments_are_refused(argv, message):
    result = train_loops(*argv)
    assert result.returncode == 2 and message in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is visible here")
def test_cuda_without_a_device_is_one_error_line():
    result = train_loops("--device", "cuda")
    assert result.returncode == 2
    error = f"error: --device cuda: torch {torch.__version__} sees no CUDA device"
    assert result.stderr.strip().splitlines() == [error]


@pytest.mark.gpu
def test_cuda_table_has_eager_and_graphed_medsweep_after_a_warmup_covering_the_capture(shared_data):
    tiny = "--device cuda --model resnet10 --size 28 --batch 2 --steps 2 --warmup 1 --repeats 2 --threads 1"
    variants = "plain,medsweep-eager,medsweep-graphed"
    result = train_loops(*tiny.split(), "--variants", variants, "--data-root", str(shared_data))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"torch \S+ \(CUDA \S+, cuDNN \d+\).*; GPU: \S.*; 1 threads \(host side\); CPU: \S", out)
    assert f"per round {GRAPH_WARMUP} warm-up + 2 timed steps" in out
    assert f"(--warmup 1 raised to {GRAPH_WARMUP}: the graphed step's eager steps and its capture)" in out
    assert "medsweep overrides: amp=true" in out
    rows = [line for line in out.splitlines() if line.startswith("| ")][1:]  # the separator starts "|-"
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert [c[0] for c in cells] == ["plain", "medsweep-eager", "medsweep-graphed"]
    assert all(float(c[5]) > 0 and float(c[7]) > 0 for c in cells)  # samples/s; peak memory grew on the GPU
