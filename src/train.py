"""Entry point: ``python -m src.train [-m] key=value ...``; each job runs :func:`src.jobs.job.train_job`.

MLflow and the job's code are imported only once the config passed the schema's checks: a wrong key or value is one
``error:`` line without them (the model zoo's registration, hence torch, comes with the composition)."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from src.cli import command
from src.folders import follower_rank
from src.parallel.preemption import Preemption
from src.perf import startup
from src.perf.startup import job_clock

startup.entry_imported()


def train(cfg: DictConfig) -> float:
    """Train and evaluate one job into its own MLflow run; returns its ``objective``.

    ``rerun=<id>`` trains that run's logged config again; ``resume=`` goes on with a stopped run. With
    ``skip_finished`` a config that already has a FINISHED run (same ``config_hash`` and ``code_fingerprint`` tags)
    is skipped, and one whose unfinished run left its checkpoint goes on with it. Out of memory: the run ends FAILED
    with tag ``status=oom``; with ``oom_retry`` a new run follows at half the micro-batch and twice the accumulation;
    otherwise a sweep goes on to its next job. A stop signal (SIGTERM, Ctrl-C) is honoured from the job's start.
    """
    with job_clock() as clock, Preemption().installed() as preemption:
        from src.jobs.fused_job import train_job  # MLflow and the job: once the config passed its checks

        clock.imported()
        return train_job(cfg, clock, preemption)


main = command("config")(train)

if __name__ == "__main__":
    if follower_rank():  # torchrun / SLURM: rank 0 owns the folder
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=stdout"]
    from src.train import main as importable_main  # launchers pickle the task by reference, not __main__'s copy

    importable_main()
