"""src/jobs/sweep_checks.py: every job of a sweep and its launcher checked before the first job starts, a bad one
refused in one line."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from src.errors import UsageError
from src.jobs.sweep_checks import check_launcher, check_sweeper
from tests.helpers import JOBLIB, one_error_line, run_cli, runs, slow, small_run


@pytest.mark.parametrize(
    "overrides,error",
    [
        (("batch_size=4,0,8",), "error: job 1 (batch_size=0): batch_size=0 must be in [1, 2147483647]"),
        (("model=resnet10,resnet7",), "error: job 1 (model=resnet7): model=resnet7 is not an option of model"),
        slow(("optim.lr=0.001,-1",), "error: job 1 (optim.lr=-1): optim.lr=-1.0 must be >= 0"),
        slow(("hydra.launcher.n_jobs=0", "seed=0,1"), "error: hydra.launcher.n_jobs=0 must be a number >= 1 or -1"),
        slow(
            ("preset=optuna", "hydra.sweeper.n_trials=0"), "error: hydra.sweeper.n_trials=0 must be a whole number >= 1"
        ),
        slow(("hydra.launcher.timeout=30", "seed=0,1"), "error: hydra.launcher.timeout=30.0: joblib kills the jobs"),
        slow(("tags=[status]", "seed=0,1"), "error: job 0 (seed=0): tags: status is a tag medsweep sets itself"),
    ],
)
def test_a_bad_job_anywhere_in_a_sweep_stops_it_before_any_job_and_any_run(
    tmp_path, store, shared_data, overrides, error
):
    """Under joblib a bad job used to fail beside a job already training, killing it and leaving it RUNNING."""
    result = run_cli("-m", *JOBLIB, *small_run(tmp_path, store, shared_data, *overrides))
    assert one_error_line(result).startswith(error)
    assert len(result.stderr.strip().splitlines()) == 1  # not Hydra's notice that the launcher's file is validated
    assert runs(store) == [] and not (tmp_path / "sweep" / "0").exists()


@pytest.mark.parametrize(
    "key,value", [("n_trials", 0), ("n_trials", -3), ("n_jobs", 0), ("n_jobs", -1), ("n_jobs", "2")]
)
def test_an_optuna_sweep_of_no_trial_or_no_trial_at_a_time_is_refused(key, value):
    """n_trials=0 ended in Optuna's `ValueError: No trials are completed yet`, n_jobs=-1 in a ZeroDivisionError: both
    tracebacks after the parent run was made."""
    optuna = {"_target_": "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper", "n_trials": 3, "n_jobs": 1}
    with pytest.raises(UsageError, match=rf"^hydra\.sweeper\.{key}={value} must be a whole number >= 1$"):
        check_sweeper(OmegaConf.create({"hydra": {"sweeper": {**optuna, key: value}}}))
    check_sweeper(OmegaConf.create({"hydra": {"sweeper": optuna}}))
    grid = {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper", "n_jobs": 0}
    check_sweeper(OmegaConf.create({"hydra": {"sweeper": grid}}))  # Hydra's grid sweeper reads no such count


@pytest.mark.parametrize("timeout,refused", [(None, False), (30, True), (0.5, True)])
def test_a_joblib_timeout_is_refused_as_it_kills_the_jobs_running_past_it(timeout, refused):
    """`hydra.launcher.timeout=30`: after 30 s joblib raised multiprocessing's TimeoutError in the main process (exit 1,
    a traceback) and killed its workers mid-step, both jobs' runs left RUNNING and the parent run FAILED."""
    joblib = {"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher", "n_jobs": 2}
    config = OmegaConf.create({"hydra": {"launcher": {**joblib, "timeout": timeout}}})
    if refused:
        with pytest.raises(UsageError, match=rf"^hydra\.launcher\.timeout={timeout}: joblib kills the jobs"):
            check_launcher(config)
    else:
        check_launcher(config)


def test_the_slurm_launcher_on_a_machine_without_slurm_is_one_line_before_any_run(
    tmp_path, store, shared_data, monkeypatch
):
    """Where SLURM's commands are not on the PATH (an empty folder here, so the test holds on a SLURM node too)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    result = run_cli("-m", "hydra/launcher=submitit_slurm", *small_run(tmp_path, store, shared_data, "seed=0,1"))
    assert one_error_line(result) == (
        "error: hydra/launcher=submitit_slurm needs SLURM (sbatch and srun on the PATH), and this machine lacks sbatch "
        "and srun: start the sweep on a SLURM login node, or use hydra/launcher=joblib or submitit_local here"
    )
    assert runs(store) == []


def test_a_one_job_sweep_is_named_by_what_changes_results_its_stores_password_left_out(tmp_path):
    uri = "postgresql+psycopg://u:secret@127.0.0.1:9/mlflow"
    result = run_cli("-m", "optim.lr=-1", f"mlflow.tracking_uri={uri}", f"hydra.sweep.dir={tmp_path}/sweep")
    assert one_error_line(result) == "error: job 0 (optim.lr=-1): optim.lr=-1.0 must be >= 0 (0 freezes the weights)"
