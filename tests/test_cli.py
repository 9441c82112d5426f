"""src/cli.py: the one command wrapper: Hydra's own flags on every command, and whatever a command refuses (Hydra's
parser, hostile input) is one ``error:`` line with exit 2, no traceback and no run."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from src.cli import hydra_arguments, reporting_composition_errors
from src.data.npz import read_npz
from src.errors import Stopped, UsageError
from src.training import checkpoint
from tests.helpers import (
    ROOT,
    alias_bomb,
    kill_group,
    one_error_line,
    run_cli,
    runs,
    small_run,
    start_command,
    wait_for_path,
)


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
    """Before its first line runs, ``python -m src.train`` imports torch and Hydra for seconds. Python's import log
    (``-X importtime``, on stderr as each import ends) says when ``src`` has installed its handler: the signal comes
    then, while the command's own modules are still importing."""
    argv = [sys.executable, "-X", "importtime", "-m", "src.train"]
    with subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        while process.stderr.readline().rpartition("|")[2].strip() != "src.data.shipped":  # after the handler
            assert process.poll() is None, "src.train ended before it imported src"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    own = [line for line in stderr.splitlines() if not line.startswith("import time:")]
    assert process.returncode == 130 and own == ["stopped (Ctrl-C)"]
    assert "| src.jobs.job" not in stderr  # stopped in the imports, before the job's code


@pytest.mark.slow
def test_sigterm_outside_a_job_ends_in_one_line_and_leaves_no_temp_file(tmp_path, store):
    """SIGTERM while a sweep's main process writes the jobs' data file, before any job: the signal's default ended the
    command at once, silent, leaving the half-written file's temp beside it; raised inside the zip writer, the
    exception its cleanup raised over it was a traceback, exit 1. The write ends, then the command, in one line."""
    root = tmp_path / "data"
    data = ("data=synthetic", f"data.root={root}", "data.size=64", "data.synthetic_samples=[800,100,100]")
    args = ("-m", *data, "device=cpu", f"mlflow.tracking_uri={store}", f"hydra.sweep.dir={tmp_path}/sweep", "seed=0,1")
    process, log = start_command(tmp_path, *args)
    try:
        wait_for_path(root, ".*.tmp", process)  # the data file is being written
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=600) == 143, log.read_text()[-3000:]
    finally:
        kill_group(process)
    text = log.read_text()
    name = "synthetic_800-100-100_64.npz"
    assert text.splitlines()[-2:] == [f"received SIGTERM: stopping when writing {name} is done", "stopped (SIGTERM)"]
    assert "Traceback" not in text, text[-3000:]
    assert [path.name for path in root.iterdir()] == [name]  # no temp file, no half file: the whole one
    assert [len(labels) for _, labels in read_npz(root / name).values()] == [800, 100, 100]
    assert runs(store) == [] and not (tmp_path / "sweep").exists()


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


@pytest.mark.parametrize(
    "argv,line",
    [
        (
            ["tags.x=模型"],
            "tags.x=模型: Hydra's override grammar takes only ASCII in an unquoted value, and '模' (U+6A21)",
        ),
        (["mlflow.experiment=résumé"], "mlflow.experiment=résumé: Hydra's override grammar takes only ASCII"),
        (["-m", "mlflow.experiment=a,résumé"], "mlflow.experiment=a,résumé: Hydra's override grammar"),
        (["tags=[a,模型]"], "tags=[a,模型]: Hydra's override grammar takes only ASCII in an unquoted value"),
        (
            ["data.root=/tmp/x\u00a0y"],
            "data.root=/tmp/x\u00a0y: Hydra's override grammar takes only ASCII in an unquoted",
        ),
    ],
    ids=["tag", "name", "sweep", "list", "no-break-space"],
)
def test_an_unquoted_non_ascii_value_is_one_error_line_naming_the_override_and_its_quoted_form(argv, line):
    """Hydra's lexer refused them as ``token recognition error at: '模'``, naming neither the override nor the fix."""
    with pytest.raises(UsageError) as refused:
        hydra_arguments(argv, "config")
    message = str(refused.value)
    assert message.startswith(line) and "\n" not in message, message
    fix = re.search(r'quote it: "([^"]+)"', message)[1]  # the override to give, as the shell passes it on
    parsed = OverridesParser.create().parse_override(fix)  # Hydra reads it, as the value that was meant
    value = argv[-1].partition("=")[2]
    assert fix.partition("=")[0] == argv[-1].partition("=")[0]
    if parsed.is_sweep_override():
        assert ",".join(getattr(v, "text", v) for v in parsed.value().list) == value  # a quoted element: its text
    elif isinstance(parsed.value(), list):
        assert f"[{','.join(parsed.value())}]" == value
    else:
        assert parsed.value() == value


def test_a_non_ascii_key_is_one_error_line_naming_it():
    with pytest.raises(UsageError) as refused:
        hydra_arguments(["modèle=resnet10"], "config")
    assert str(refused.value).startswith("modèle=resnet10: a key is ASCII letters, digits, '_', '-' and '.', and 'è'")


@pytest.mark.slow
def test_an_unquoted_non_ascii_override_ends_a_command_in_one_line_leaving_no_folder(tmp_path):
    result = run_cli("-m", "tags.x=模型", "seed=0,1", cwd=tmp_path)  # was: error: token recognition error at: '模'
    line = one_error_line(result)
    assert line.startswith("error: tags.x=模型: ") and line.endswith("quote it: \"tags.x='模型'\""), line
    quoted = run_cli("-m", "tags.x='模型'", "seed=0,1", cwd=tmp_path)  # as the line says: tags is a list, though
    assert one_error_line(quoted) == (  # was: ValueError: invalid literal for int() with base 10: 'x', a traceback
        "error: tags.x='模型': tags is a list, its elements numbered (tags.0, tags.1 ...), none named 'x': give the "
        "whole list, tags=[...]"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_swept_range_with_step_0_in_the_sweepers_params_is_one_error_line(tmp_path):
    done = run_cli("-m", "+hydra.sweeper.params={seed:'range(0,3,0)'}", f"hydra.sweep.dir={tmp_path}/sweep")
    assert (done.returncode, done.stderr.strip().splitlines()) == (
        2,
        ["error: seed=range(0,3,0): range() arg 3 must not be zero"],
    ), done.stdout[-2000:]  # was: the checks' traceback on stdout, exit 1
    assert not (tmp_path / "sweep").exists()


# -- hostile input: each case a real command that must end in one error line, exit 2, no run ---------------


def synthetic(root: Path, **arrays: np.ndarray) -> str:
    """A synthetic file of 4/2/2 samples (its name says so) holding ``arrays`` in place of the good ones."""
    good = {"images": lambda n: np.zeros((n, 28, 28, 28), np.uint8), "labels": lambda n: np.zeros((n, 1), np.uint8)}
    content = {f"{s}_{k}": make(n) for s, n in (("train", 4), ("val", 2), ("test", 2)) for k, make in good.items()}
    np.savez(root / "synthetic_4-2-2.npz", **{**content, **arrays})
    return "data=synthetic data.synthetic_samples=[4,2,2]"


def random_bytes(path: Path) -> Path:
    path.write_bytes(os.urandom(4096))
    return path


CASES = {  # name: (module, overrides as one string); {tmp}, {store} and {data} are filled in
    "negative gamma": ("src.train", "sched.gamma=-1"),
    "negative lr": ("src.train", "optim.lr=-0.1"),
    "NaN lr": ("src.train", "optim.lr=nan"),
    "negative weight decay": ("src.train", "optim.weight_decay=-1"),
    "beta above 1": ("src.train", "optim.betas=[1.5,0.999]"),
    "one beta": ("src.train", "optim.betas=[0.9]"),
    "negative seed": ("src.train", "seed=-1"),
    "empty experiment": ("src.train", "mlflow.experiment="),
    "cyclic with warm-up": ("src.train", "sched=cyclic warmup_epochs=1"),
    "zero epochs": ("src.train", "epochs=0"),
    "CUDA graphs required on the CPU": ("src.train", "cuda_graphs=true"),
    "CUDA graphs maybe": ("src.train", "cuda_graphs=maybe"),
    "size 32": ("src.train", "data.size=32"),
    "classes that do not fit": ("src.train", "data.num_classes=3"),
    "a tag that is not a name": ("src.train", "tags=[bad tag]"),
    "a reserved tag": ("src.train", "tags=[status]"),
    "resume of nothing": ("src.train", "resume=0f00ba4"),
    "rerun of nothing": ("src.train", "rerun=0f00ba4"),
    "a sweep with a bad job under joblib": ("src.train", "-m hydra/launcher=joblib batch_size=4,0,8"),
    "no joblib workers": ("src.train", "-m hydra/launcher=joblib hydra.launcher.n_jobs=0 seed=0,1"),
    "joblib workers past jobs and CPUs": ("src.train", "-m hydra/launcher=joblib hydra.launcher.n_jobs=999 seed=0,1"),
    "a collective timeout past timedelta": ("src.train", "parallel=ddp parallel.timeout_s=100000000000000"),
    "a reserved tag in a sweep": ("src.train", "-m tags=[status] seed=0,1"),
    "report margin below 0": ("src.report", "margin=-0.1 mlflow.experiment=medsweep"),
    "report tag that is not a name": ("src.report", "tags=[bad tag] mlflow.experiment=medsweep"),
    "summary of size 32": ("src.summary", "data.size=32"),
    "memory of batch 0": ("src.memory", "batch_size=0"),
    "store of random bytes": ("src.train", "mlflow.tracking_uri=sqlite:///{tmp}/random.db"),
    "store naming a folder": ("src.train", "mlflow.tracking_uri=sqlite:///{tmp}"),
    "store server down": ("src.train", "mlflow.tracking_uri=http://127.0.0.1:9"),
    "PostgreSQL down": ("src.train", "mlflow.tracking_uri=postgresql+psycopg://u:p@127.0.0.1:9/mlflow"),
    "a sweep on a store of random bytes": ("src.train", "-m seed=0,1 mlflow.tracking_uri=sqlite:///{tmp}/random.db"),
    "synthetic file of random bytes": ("src.train", "data=synthetic data.root={tmp}/bytes"),
    "labels out of range": ("src.train", "{labels} data.root={tmp}/labels"),
    "fewer labels than images": ("src.train", "{short} data.root={tmp}/short"),
    "an empty split": ("src.train", "{empty} data.root={tmp}/empty"),
    "NaN images": ("src.train", "{nan} data.root={tmp}/nan"),
    "the 64^3 file under the 28^3 name": ("src.train", "data.root={tmp}/renamed"),
    "missing file, no download": ("src.train", "data=vesselmnist3d data.root={tmp} data.download=false"),
    "download offline": (
        "src.train",
        "data=organmnist3d data.root={tmp} data.download=true data.url=http://127.0.0.1:9/o",
    ),
    "a sweep whose download fails": (
        "src.train",
        "-m seed=0,1 data=organmnist3d data.root={tmp} data.download=true data.url=http://127.0.0.1:9/o",
    ),
    "resume of a truncated checkpoint": ("src.train", "resume={tmp}/truncated"),
    "threads past any machine": ("src.train", "num_threads=100000"),
    "a process per worker past any machine": ("src.train", "data.loader=dataloader data.num_workers=100000"),
    "a batch past the memory budget": ("src.train", "mem_budget_mb=1"),
    "one sample on BatchNorm's 1^3 map": ("src.train", "batch_size=1"),
    "a job in its own folder": ("src.train", "hydra.job.chdir=true"),
    "sweep jobs in their own folders": ("src.train", "-m hydra.job.chdir=true seed=0,1"),
    "an in-memory store": ("src.train", "mlflow.tracking_uri=sqlite://"),
    "a store in a folder that takes no files": ("src.train", "mlflow.tracking_uri=sqlite:////proc/medsweep.db"),
    "a sweep with no jobs": ("src.train", "-m seed=range(42,42)"),
    "a job folder that cannot be written": ("src.train", "-m seed=0,1 hydra.sweep.subdir=/proc/x"),
    "Hydra's config copy where none can be written": ("src.train", "hydra.output_subdir=/proc/x"),
    "a report's Hydra folder that cannot be made": ("src.report", "hydra.run.dir=/proc/x mlflow.experiment=medsweep"),
    "a summary's Hydra folder that cannot be made": ("src.summary", "hydra.run.dir=/proc/x"),
    "a memory table's Hydra folder that cannot be made": ("src.memory", "hydra.run.dir=/proc/x"),
    "a volume cache's Hydra folder that cannot be made": ("src.volumes", "hydra.run.dir=/proc/x"),
    "a sweep's config copies where none can be written": ("src.train", "-m seed=0,1 hydra.output_subdir=/proc/x"),
    "a log file where none can be written": ("src.train", "hydra.job_logging.handlers.file.filename=/proc/x/a.log"),
    "a sweep's log files where none can be written": (
        "src.train",
        "-m seed=0,1 hydra.job_logging.handlers.file.filename=/proc/x/a.log",
    ),
    "a group set to null": ("src.train", "model=null"),
    "a list of models": ("src.train", "model=[resnet10,resnet18]"),
    "a preset's sweep without -m": ("src.train", "preset=seeds"),
    "the sweeper's params set, not added": ("src.train", '-m hydra.sweeper.params={{seed:"0,1"}}'),
    "two jobs in one folder": ("src.train", "-m seed=0,1 hydra.sweep.subdir=same"),
    "a job in the sweep's own folder": ("src.train", "-m seed=0,1 hydra.sweep.subdir="),
    "an interval sweep without Optuna": ("src.train", "-m seed=interval(0,3)"),
    "a config folder that does not exist": ("src.train", "-cd /no/such/folder"),
    "another command's config": ("src.train", "-cn memory"),  # trained into the working directory
    "a config path without the schema": ("src.train", "-cp {tmp}"),
    "a schema key deleted": ("src.train", "~seed"),  # trained seed 0 under another hash than seed=0's
    "the store's keys deleted": ("src.train", "~mlflow"),  # logged to the default store, not the one given
    "a cycle past torch's step count": ("src.train", "sched=cyclic sched.cycle_epochs=1e308"),
    "system metrics sampled never": ("src.train", "mlflow.system_metrics_interval_s=1e308"),
    "noise past the intensity scale": ("src.train", "aug=standard aug.noise_std=1e308"),
    "a value past MLflow's param length": ("src.train", "aug.name=" + "x" * 6001),  # MLflow cut the run's param
    "synthetic volumes past any memory": (
        "src.train",
        "data=synthetic data.synthetic_samples=[100000000,1,1] data.root={tmp}",
    ),
}


@pytest.fixture
def hostile(tmp_path, shared_data) -> dict[str, str]:
    """The files the cases name, made in ``tmp_path``."""
    random_bytes(tmp_path / "random.db")
    folders = {name: tmp_path / name for name in ("bytes", "labels", "short", "empty", "nan", "renamed", "truncated")}
    for folder in folders.values():
        folder.mkdir()
    random_bytes(folders["bytes"] / "synthetic_256-64-64.npz")
    shutil.copy(shared_data / "adrenalmnist3d_64.npz", folders["renamed"] / "adrenalmnist3d.npz")
    state = {"run_id": "0f00ba4", "epoch": 1, "step": 0, "batch_size": 4, "accumulate": 1, "world": 1, "config": {}}
    checkpoint.save(state, folders["truncated"] / checkpoint.FILE)
    path = folders["truncated"] / checkpoint.FILE
    path.write_bytes(path.read_bytes()[:100])
    return {
        "labels": synthetic(folders["labels"], train_labels=np.full((4, 1), 7, np.uint8)),
        "short": synthetic(folders["short"], val_labels=np.zeros((1, 1), np.uint8)),
        "empty": synthetic(folders["empty"], test_images=np.zeros((0, 28, 28, 28), np.uint8)),
        "nan": synthetic(folders["nan"], train_images=np.full((4, 28, 28, 28), np.nan, np.float32)),
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_each_hostile_case_ends_in_one_error_line_and_creates_no_run(tmp_path, store, shared_data, hostile, case):
    module, overrides = CASES[case]
    filled = overrides.format(tmp=tmp_path, **hostile).split()
    sweep = filled[:1] == ["-m"]
    base = [a for a in small_run(tmp_path, store, shared_data) if not a.startswith(tuple(k for k in keys(filled)))]
    args = [*filled[:1], *(base if module == "src.train" else keys_only(filled, store)), *filled[sweep:]]
    result = run_cli(*args, module=module, timeout=300)
    assert result.returncode == 2, (case, result.stderr[-3000:])
    assert "Traceback" not in result.stdout + result.stderr, (case, result.stderr[-3000:])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and result.stderr.strip().splitlines()[-1] == errors[0], (case, result.stderr[-3000:])
    uri = next((a.partition("=")[2] for a in args if a.startswith("mlflow.tracking_uri=")), store)
    if uri == store:
        assert runs(store) == [], case


def keys(overrides: list[str]) -> set[str]:
    """The keys the case sets (with ``data`` its whole group): the base run's values of them are dropped."""
    named = {o.partition("=")[0] for o in overrides if "=" in o}
    return named | ({"data"} if named & {"data", "data.root"} else set())


def keys_only(overrides: list[str], store: str) -> list[str]:
    """Another command than src.train: only its store next to the case's own overrides."""
    return [] if any(o.startswith("mlflow.tracking_uri=") for o in overrides) else [f"mlflow.tracking_uri={store}"]


@pytest.mark.parametrize("module", ["src.train", "src.summary"])
def test_a_run_folder_whose_interpolation_does_not_resolve_is_only_one_error_line(tmp_path, module):
    """Hydra printed its callback's exception as a 5-line UserWarning before the error line."""
    result = run_cli(f"hydra.run.dir={tmp_path}/${{oc.env:MEDSWEEP_UNSET_X}}", module=module, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "error: hydra.run.dir: KeyError raised while resolving interpolation: "
        "\"Environment variable 'MEDSWEEP_UNSET_X' not found\""
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_an_experiment_file_holding_an_alias_bomb_is_one_line(tmp_path, store):
    """``--config-dir <folder>`` holding ``experiment/<name>.yaml`` is how a recipe of one's own is given (a shared
    folder, maybe): Hydra loads YAML unbounded, and an alias bomb there hung the command (its SIGTERM too)."""
    (tmp_path / "recipes" / "experiment").mkdir(parents=True)
    (tmp_path / "recipes" / "experiment" / "bomb.yaml").write_text("# @package _global_\n" + alias_bomb(levels=8))
    result = run_cli(
        "--config-dir",
        str(tmp_path / "recipes"),
        "experiment=bomb",
        "dry_run=true",
        f"mlflow.tracking_uri={store}",
        f"hydra.run.dir={tmp_path}/run",
        timeout=60,
    )
    assert one_error_line(result).startswith(
        f"error: {tmp_path / 'recipes' / 'experiment' / 'bomb.yaml'} holds more than 20000 values once its YAML aliases"
    )


@pytest.fixture
def own_handlers():
    """The signal handlers a command's wrapper sets, put back after the test."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize(
    "stop,code,line", [(Stopped(signal.SIGTERM), 143, "SIGTERM"), (KeyboardInterrupt(), 130, "Ctrl-C")]
)
def test_an_error_a_library_raises_over_a_stop_ends_as_the_stop(stop, code, line, monkeypatch, capsys, own_handlers):
    """A signal cut a library's write; its cleanup failed over it (zipfile's ``ValueError``): a traceback, exit 1."""

    def main() -> None:
        try:
            raise stop
        except BaseException:
            raise ValueError("Can't close the ZIP file while there is an open writing handle on it") from None

    monkeypatch.setattr(sys, "argv", ["train"])
    with pytest.raises(SystemExit) as ended:
        reporting_composition_errors(main, "train")()
    assert ended.value.code == code and capsys.readouterr().err == f"stopped ({line})\n"
