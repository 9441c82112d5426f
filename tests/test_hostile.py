"""Hostile input, end to end: each case is a real command that must end in exactly one ``error:`` line, exit 2, no
traceback and no MLflow run (slow: ~5 s a process). The cases that must recover instead are in jobs/test_recovery.py and
jobs/test_sweeps.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from src.training import checkpoint
from tests.helpers import run_cli, runs, small_run


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
