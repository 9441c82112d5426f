"""``python -m src.summary``: one line per model, a stage table, the dsconv FLOP ratio; real processes."""

from __future__ import annotations

import re

import pytest
import torch

from src.config import DataConfig, ModelConfig
from src.models import build_model
from src.models.profile import forward_flops
from src.summary import summarize
from tests.helpers import run_cli

DATA = DataConfig(name="synthetic", num_classes=2)

LINE = re.compile(r"^model=(\w+) size=(\d+) params=(\d+) gflops=(\d+\.\d{3}) out=\((\d+),(\d+)\)$", re.MULTILINE)


def test_densenet121_at_64_with_the_standard_stem():
    result = run_cli("model=densenet121", "model.stem=standard", "data.size=64", module="src.summary")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert LINE.fullmatch(lines[0]).groups()[:3] == ("densenet121", "64", "11244674")
    assert LINE.fullmatch(lines[0]).groups()[4:] == ("1", "2")
    assert [line.split()[0] for line in lines[2:]] == [
        "stem",
        "block1",
        "transition1",
        "block2",
        "transition2",
        "block3",
        "transition3",
        "block4",
        "head",
    ]
    assert "(1,1024,2,2,2)" in lines[-2]


def test_sweep_prints_one_line_per_model(tmp_path):
    result = run_cli(
        "-m", "model=resnet18,densenet121", f"hydra.sweep.dir={tmp_path}", module="src.summary", timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert [match[0] for match in LINE.findall(result.stdout)] == ["resnet18", "densenet121"]


@pytest.mark.parametrize(
    "module,overrides,message",
    [
        ("src.summary", ("model=resnet10,resnet18", "data.size=28,99"), "data.size=99 is not a MedMNIST 3D size"),
        ("src.memory", ("model=resnet10,resnet18", "batch_size=2,0"), "batch_size=0 must be in [1, 2147483647]"),
    ],
    ids=["summary", "memory"],
)
def test_a_sweep_with_one_bad_job_prints_nothing_before_its_error_line(tmp_path, module, overrides, message):
    """Every job is checked before the first prints, as a training sweep's are."""
    result = run_cli("-m", *overrides, f"hydra.sweep.dir={tmp_path}", module=module, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: job 1 (") and message in last


IGNORED = (  # the zoo's check (src.models.registry.check_model), wherever a command composes a model
    "model.checkpointing=true: model=resnet18 ignores it; drop it, or use a model that acts on it: densenet121, "
    "densenet169, densenet201, densenet264"
)


@pytest.mark.parametrize(
    "module,args,line",
    [
        ("src.summary", ("model=resnet18",), IGNORED),
        ("src.summary", ("-m", "model=resnet18,densenet121"), f"job 0 (model=resnet18): {IGNORED}"),
        ("src.memory", ("model=resnet18",), IGNORED),
        ("src.volumes", ("model=resnet18",), IGNORED),
    ],
    ids=["summary", "summary-sweep", "memory", "volumes"],
)
def test_a_switch_the_model_ignores_is_refused_by_every_command_composing_it(tmp_path, module, args, line):
    """``python -m src.summary model=resnet18 model.checkpointing=true`` printed resnet18's summary: the check ran
    only as a run was planned."""
    result = run_cli(*args, "model.checkpointing=true", f"hydra.sweep.dir={tmp_path}", module=module, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and result.stderr.strip().splitlines() == [f"error: {line}"]


def test_dsconv_ratio_against_the_dense_model():
    text = summarize(ModelConfig(name="resnet18", dsconv=True), DATA)
    flops = {}
    for dsconv in (False, True):
        with torch.device("meta"):
            model = build_model(ModelConfig(name="resnet18", dsconv=dsconv), DATA).eval()
        flops[dsconv] = forward_flops(model, torch.empty(1, 1, 28, 28, 28, device="meta"))
    assert LINE.match(text).group(4) == f"{flops[True] / 1e9:.3f}"
    assert text.splitlines()[-1] == f"dsconv flop ratio vs dense: {flops[True] / flops[False]:.3f}"
    assert "flop ratio" not in summarize(ModelConfig(name="resnet18"), DATA)
