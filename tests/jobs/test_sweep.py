"""src/jobs/sweep.py: the sweep's callback: each job's folder apart from the sweep's and the others', an Optuna trial
that returned NaN recorded as failed."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from src.errors import UsageError
from src.jobs.sweep import check_job_folders
from src.jobs.sweep_checks import SweepJob


def sweep_job(num: int, sweep: Path, subdir: str) -> SweepJob:
    hydra_cfg = OmegaConf.create(
        {"runtime": {"output_dir": str((sweep / subdir).resolve())}, "sweep": {"subdir": subdir}}
    )
    return SweepJob(num, f"job{num}", [], OmegaConf.create(), hydra_cfg)


@pytest.mark.parametrize(
    "subdirs,error",
    [
        (["0", "1", "10", "1-0"], None),
        (["0", "0"], "hydra.sweep.subdir=0 (job 1's folder {sweep}/0) is job 0's folder"),
        (["a", "a/b"], "job 0's folder {sweep}/a holds job 1's folder {sweep}/a/b"),
        (["a/b/c", "x", "a"], "job 2's folder {sweep}/a holds job 0's folder {sweep}/a/b/c"),
        (["0", "."], "hydra.sweep.subdir=. (job 1's folder {sweep}) is or holds the sweep's folder {sweep}"),
        (["0", ".."], "hydra.sweep.subdir=.. (job 1's folder {tmp}) is or holds the sweep's folder {sweep}"),
    ],
)
def test_each_job_of_a_sweep_has_a_folder_apart_from_the_sweeps_and_the_others(tmp_path, subdirs, error):
    sweep = tmp_path / "sweep"
    jobs = [sweep_job(num, sweep, subdir) for num, subdir in enumerate(subdirs)]
    if error is None:
        check_job_folders(sweep, jobs)
        return
    with pytest.raises(UsageError) as refused:
        check_job_folders(sweep, jobs)
    assert str(refused.value).startswith(error.format(sweep=sweep, tmp=tmp_path))
    assert str(refused.value).endswith(
        "give each job a folder of its own in the sweep's (hydra.sweep.subdir, default ${hydra.job.num})"
    )


def test_the_optuna_sweeper_records_a_trial_that_returned_nan_as_failed_and_goes_on(monkeypatch):
    """A trial stopped by SIGTERM (or out of memory, diverged) returns NaN: hydra-optuna-sweeper told it FAIL with
    that value, Optuna refused (`ValueError: Values were told. Values cannot be specified when state is ... FAIL`),
    and `python -m src.train -m preset=optuna` ended in a traceback, exit 1, rather than `SIGTERM stopped the sweep`."""
    import optuna

    from src.jobs.sweep import told_failures

    monkeypatch.setattr(optuna.study.Study, "tell", optuna.study.Study.tell)  # undone after the test
    told_failures()
    told_failures()  # once only
    study = optuna.create_study(direction="maximize")
    done, stopped = study.ask(), study.ask()
    study.tell(done, 0.9)
    with pytest.raises(ValueError, match="returned nan"):
        study.tell(stopped, [float("nan")], optuna.trial.TrialState.COMPLETE)  # as the sweeper tells it first
    study.tell(stopped, state=optuna.trial.TrialState.FAIL, values=[float("nan")])  # then as failed
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL]
    assert study.best_trial.number == 0
