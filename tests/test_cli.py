"""Hydra's own flags on every command: a switch after the overrides is taken as meant, and what Hydra's parser refuses
is one ``error:`` line (exit 2), not its usage lines or a traceback."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from src.cli import hydra_arguments
from src.errors import UsageError
from tests.helpers import ROOT, run_cli, runs, small_run


@pytest.mark.parametrize(
    "argv,ordered",
    [
        (["model=resnet10", "-m", "seed=0,1"], ["-m", "model=resnet10", "seed=0,1"]),
        (["seed=0,1", "--multirun"], ["--multirun", "seed=0,1"]),
        (["seed=1", "--resolve", "--cfg", "job"], ["--resolve", "--cfg", "job", "seed=1"]),
        (["seed=1", "--cfg", "job", "amp=true"], ["--cfg", "job", "seed=1", "amp=true"]),  # was: unrecognized amp=true
        (["seed=1", "-cn", "config", "amp=true", "--info"], ["-cn", "config", "seed=1", "amp=true", "--info"]),
        (["--info", "seed=1"], ["seed=1", "--info"]),  # was: invalid choice 'seed=1'
        (["--info", "config", "seed=1"], ["--info", "config", "seed=1"]),
        (["--cfg", "job", "-p", "model"], ["--cfg", "job", "-p", "model"]),
        (["seed=1", "--help"], ["seed=1", "--help"]),
        ([], []),
    ],
)
def test_hydra_switches_go_before_the_overrides(argv, ordered):
    assert hydra_arguments(argv, "config") == ordered


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--foo"], "unrecognized arguments: --foo"),
        (["--cfg"], "argument --cfg/-c: expected one argument"),
        (["--cfg", "-m"], "argument --cfg/-c: expected one argument"),
        (["--info", "bogus"], "argument --info/-i: invalid choice: 'bogus'"),
        (["seed=0,1", "-m", "--cfg", "job"], "--multirun and --cfg together: give one of them"),
        (["--resolve"], "--resolve works with --cfg or --help only"),
        (["--experimental-rerun", "/no/such.pickle"], "--experimental-rerun: use rerun=<MLflow run id>"),
        (["--shell-completion"], "--shell-completion takes one of install=<shell>"),
        (["-sc", "install=tcsh"], "--shell-completion takes one of install=<shell>"),
        (["-sc", "query=bash"], "--shell-completion query=<shell> is the shell's own call"),
    ],
)
def test_what_hydra_refuses_is_one_usage_error(argv, message):
    with pytest.raises(UsageError) as refused:
        hydra_arguments(argv, "config")
    assert str(refused.value).startswith(message)
    assert str(refused.value).endswith("(the overrides are key=value; --help lists the flags)")


@pytest.mark.parametrize("argv,given", [(["-cn", "memory"], "-cn memory"), (["seed=1", "-cp", "/tmp"], "-cp /tmp")])
def test_a_primary_config_other_than_the_commands_is_refused(argv, given):
    """``src.train -cn memory`` took src.memory's Hydra settings: it trained into the working directory."""
    line = (
        f"{given}: this command composes conf/config.yaml, whose Hydra settings it relies on: drop it (a recipe of "
        "your own: --config-dir <folder> holding experiment/<name>.yaml, then experiment=<name>)"
    )
    with pytest.raises(UsageError, match=f"^{re.escape(line)}$"):
        hydra_arguments(argv, "config")
    assert hydra_arguments(["-cn", "config", "seed=1"], "config") == ["-cn", "config", "seed=1"]


@pytest.mark.parametrize("argv", [["model=[resnet10,resnet18]"], ["-m", "model=[resnet10,resnet18],resnet34"]])
def test_a_list_of_a_groups_options_is_refused(argv):
    """Hydra merges a list of a group's options into one config, the last one's values winning."""
    with pytest.raises(UsageError, match=r"model takes one option, and a list of them merges them into one"):
        hydra_arguments(argv, "config")


@pytest.mark.parametrize("argv", [["-m", "preset=[seeds,models]"], ["-m", "model=glob(resnet1*)"], ["aug=standard"]])
def test_presets_merge_as_a_list_and_a_glob_sweeps_options(argv):
    assert hydra_arguments(argv, "config") == argv


def test_the_sweepers_params_added_on_the_command_line_are_swept(tmp_path, store, shared_data):
    """``+hydra.sweeper.params={...}`` sweeps as a preset's do: job 1 is ``optim.lr=-1``, refused before any run."""
    result = run_cli("-m", *small_run(tmp_path, store, shared_data), '+hydra.sweeper.params={optim.lr:"0.001,-1"}')
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        "error: job 1 (optim.lr=-1): optim.lr=-1.0 must be >= 0 (0 freezes the weights)"
    ]
    assert runs(store) == []


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
    assert result.stderr.splitlines() == ["error: job 1 (epochs=0): epochs=0 must be in [1, 2147483647]"]
    assert runs(store) == []


def test_the_report_runs_once_not_as_a_sweep(tmp_path):
    result = run_cli("-m", "margin=0.1", module="src.report", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: -m: this command runs once, not as a sweep: give no -m"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "module,args",
    [
        ("src.memory", ("model=resnet10", "batch_size=2")),
        ("src.memory", ("-m", "model=resnet10", "batch_size=2,4")),
        ("src.summary", ("model=resnet10",)),
        ("src.train", ("--cfg", "job")),
    ],
    ids=["memory", "memory-sweep", "summary", "train-cfg"],
)
def test_a_command_that_writes_nothing_leaves_no_folder(tmp_path, module, args):
    """Hydra resolves conf/config.yaml's default folders (``${fresh:outputs/...}``, ``${fresh:sweeps/...}``), which
    claims them, even where a command's config or a flag replaces them: they go at the command's end."""
    result = run_cli(*args, module=module, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_an_int_past_the_float_range_is_one_error_line_naming_its_key():
    result = run_cli(f"optim.lr={10**400}", module="src.memory")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: optim.lr: a number past the float range: give one below 1e308"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,line",
    [
        (
            ("seed=${oc.env:MEDSWEEP_UNSET}",),
            'seed=${oc.env:MEDSWEEP_UNSET}: KeyError raised while resolving interpolation: "Environment variable',
        ),
        (("-m", "seed=0,${nonexist}"), "Interpolation key 'nonexist' not found"),
    ],
    ids=["run", "sweep"],
)
def test_an_interpolation_that_does_not_resolve_is_one_error_line_before_any_run(
    tmp_path, store, shared_data, args, line
):
    """In a sweep Hydra turns a callback's error into a warning and starts the jobs unchecked: job 0 trained."""
    result = run_cli(*args[:-1], *small_run(tmp_path, store, shared_data), args[-1])
    assert result.returncode == 2, result.stderr[-3000:]
    (error,) = result.stderr.splitlines()
    assert error.startswith("error: ") and line in error
    assert runs(store) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "variable,value",
    [("LOCAL_WORLD_SIZE", "0"), ("LOCAL_WORLD_SIZE", "abc"), ("SUBMITIT_PREEMPT_SIGNAL", "FOO")],
)
def test_a_stray_launcher_variable_is_one_error_line_before_any_run(
    tmp_path, store, shared_data, monkeypatch, variable, value
):
    monkeypatch.setenv(variable, value)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")  # where submitit's signal is read
    result = run_cli(*small_run(tmp_path, store, shared_data))
    assert result.returncode == 2, result.stderr[-3000:]
    (error,) = result.stderr.splitlines()
    assert error.startswith(f"error: {variable}={value} in the environment ")
    assert runs(store) == []


def test_ctrl_c_while_the_command_imports_is_one_line():
    """Before its first line runs, ``python -m src.train`` imports torch and Hydra for seconds."""
    with subprocess.Popen(
        [sys.executable, "-m", "src.train"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        time.sleep(0.3)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and stderr.splitlines() == ["stopped (Ctrl-C)"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["seed=" + "9" * 5000], "seed: Exceeds the limit (4300 digits) for integer string conversion"),
        (["-m", "seed=range(0,3,0)"], "seed: range() arg 3 must not be zero"),
    ],
)
def test_a_value_hydra_fails_on_with_a_value_error_is_one_usage_error(argv, message):
    with pytest.raises(UsageError) as refused:  # was: Hydra's ValueError, a traceback and exit 1
        hydra_arguments(argv, "config")
    assert str(refused.value).startswith(message)


def test_a_swept_range_with_step_0_in_the_sweepers_params_is_one_error_line(tmp_path):
    done = run_cli("-m", "+hydra.sweeper.params={seed:'range(0,3,0)'}", f"hydra.sweep.dir={tmp_path}/sweep")
    assert (done.returncode, done.stderr.strip().splitlines()) == (
        2,
        ["error: seed=range(0,3,0): range() arg 3 must not be zero"],
    ), done.stdout[-2000:]  # was: the checks' traceback on stdout, exit 1
    assert not (tmp_path / "sweep").exists()
