"""Hydra's own flags on every command: a switch after the overrides is taken as meant, and what Hydra's parser refuses
is one ``error:`` line (exit 2), not its usage lines or a traceback."""

from __future__ import annotations

import pytest

from src.cli import hydra_arguments
from src.errors import UsageError
from tests.helpers import run_cli, runs, small_run


@pytest.mark.parametrize(
    "argv,ordered",
    [
        (["model=resnet10", "-m", "seed=0,1"], ["-m", "model=resnet10", "seed=0,1"]),
        (["seed=0,1", "--multirun"], ["--multirun", "seed=0,1"]),
        (["seed=1", "--resolve", "--cfg", "job"], ["--resolve", "seed=1", "--cfg", "job"]),
        (["--cfg", "job", "-p", "model"], ["--cfg", "job", "-p", "model"]),
        (["seed=1", "--help"], ["seed=1", "--help"]),
        ([], []),
    ],
)
def test_hydra_switches_go_before_the_overrides(argv, ordered):
    assert hydra_arguments(argv) == ordered


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--foo"], "unrecognized arguments: --foo"),
        (["--cfg"], "argument --cfg/-c: expected one argument"),
        (["--cfg", "-m"], "argument --cfg/-c: expected one argument"),
        (["--info", "bogus"], "argument --info/-i: invalid choice: 'bogus'"),
        (["seed=0,1", "-m", "--cfg", "job"], "--multirun and --cfg together: give one of them"),
        (["--resolve"], "--resolve works with --cfg or --help only"),
    ],
)
def test_what_hydra_refuses_is_one_usage_error(argv, message):
    with pytest.raises(UsageError) as refused:
        hydra_arguments(argv)
    assert str(refused.value).startswith(message)
    assert str(refused.value).endswith("(the overrides are key=value; --help lists the flags)")


@pytest.mark.parametrize("module", ["src.train", "src.report"])
def test_an_unknown_flag_is_one_error_line(module):
    result = run_cli("--epochs=3", module=module)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: unrecognized arguments: --epochs=3 (the overrides are key=value; --help lists the flags)"
    ]


def test_multirun_given_after_the_overrides_sweeps(tmp_path, store, shared_data):
    """``epochs=1,0 -m`` is a sweep of two jobs: its checks name job 1, before any run."""
    result = run_cli(*small_run(tmp_path, store, shared_data, "epochs=1,0"), "-m")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: job 1 (epochs=0): epochs=0 must be >= 1"]
    assert runs(store) == []
