"""How a job ends: skipped (a FINISHED run has its config), out of memory (its run FAILED with ``status=oom``,
maybe retried at half the micro-batch), preempted (its run KILLED and resumable), or FINISHED (its artifacts
logged, its checkpoint deleted unless ``checkpoint.keep=always``)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Iterator, NoReturn

import mlflow

from src.config import CheckpointKeep, Config
from src.errors import UsageError
from src.jobs.plan import Plan
from src.parallel.preemption import EXIT_PREEMPTED, Preempted, PreemptedExit, Preemption
from src.perf.memory import predict
from src.tracking.identity import code_fingerprint
from src.tracking.runs import RunLogger
from src.tracking.store import best_metric
from src.tracking.sweep import SKIPPED_TAG, job_parent_id
from src.training import checkpoint

log = logging.getLogger(__name__)


def skip(plan: Plan) -> float:
    """Train nothing: log why, list the job on the sweep's parent run, return the finished run's objective."""
    done = plan.finished
    same = "config" if plan.cfg.skip_finished == "config" else f"config and code_fingerprint {code_fingerprint()}"
    log.info("skipping %s: run %s FINISHED with the same %s", plan.run_name, done.info.run_id, same)
    client = mlflow.MlflowClient(plan.tracking_uri)
    if parent_id := job_parent_id():
        RunLogger(client, parent_id).set_tags(
            {f"{SKIPPED_TAG}{plan.job_num}": f"{' '.join(plan.overrides)} -> {done.info.run_id}"}
        )
    return best_metric(client, done.info.run_id, plan.cfg.objective)


def attempts(cfg: Config) -> Iterator[Config]:
    """The config, then, while ``oom_retry`` allows, half the micro-batch and twice the accumulation (the same
    effective batch) after each out-of-memory attempt."""
    while True:
        yield cfg
        if not (cfg.oom_retry and cfg.batch_size > 1):
            return
        cfg = dataclasses.replace(cfg, batch_size=cfg.batch_size // 2, accumulate=cfg.accumulate * 2)


def read_oom(output_dir: Path) -> dict[str, float] | None:
    """The memory reached by the ranks that ran out of memory (their ``oom_rank<k>.json``), consumed."""
    records = sorted(output_dir.glob("oom_rank*.json"))
    if not records:
        return None
    peaks = [json.loads(path.read_text())["mem/peak_mb"] for path in records]
    for path in records:
        path.unlink()
    return {"mem/peak_mb": max(peaks)}


def failed(run: RunLogger, cfg: Config, plan: Plan, error: BaseException) -> bool:
    """Close the run of a failed attempt. Out of memory: FAILED, tagged ``status=oom`` and whether it is retried;
    True to retry (``oom_retry``), False in a sweep (it goes on), a :class:`UsageError` for a single run. Any other
    error: FAILED (KILLED on Ctrl-C), and raised again."""
    oom = read_oom(plan.output_dir)
    if oom is None:
        run.finish("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
        raise error
    retry = cfg.oom_retry and cfg.batch_size > 1
    run.set_tags({"status": "oom", "retried": str(retry).lower()})
    run.log_metrics({**oom, "mem/predicted_mb": predict(cfg, plan.device).total_mb}, step=0)
    run.finish("FAILED")
    message = f"out of memory at batch_size={cfg.batch_size} (peak {oom['mem/peak_mb']:.0f} MiB)"
    if retry:
        log.warning("%s: retrying with batch_size=%d accumulate=%d", message, cfg.batch_size // 2, cfg.accumulate * 2)
    elif plan.multirun:
        log.error("%s: run %s FAILED (status=oom); the sweep goes on", message, run.run_id)
    else:
        raise UsageError(f"{message}: lower batch_size, or set oom_retry=true") from None
    return retry


def stop_preempted(run: RunLogger, stop: Preempted, preemption: Preemption) -> NoReturn:
    """A stop signal was honoured and the checkpoint written: the run ends KILLED, tagged resumable; a signal
    submitit sent goes back to submitit (it requeues the job, which resumes by itself); else exit 143."""
    run.set_tags({"preempted": "true", "resume_with": f"resume={run.run_id}"})
    run.finish("KILLED")
    log.warning(
        "preempted (%s): run %s is KILLED and resumable: python -m src.train resume=%s", stop, run.run_id, run.run_id
    )
    try:
        preemption.hand_over()
    except SystemExit as handed:  # submitit requeued the job; its exit code tells its controller so
        raise PreemptedExit(handed.code) from None
    raise PreemptedExit(EXIT_PREEMPTED)


def log_outputs(run: RunLogger, output_dir: Path, job_dir: Path) -> None:
    """The run's folder as artifacts (``.hydra/``, ``eval/``, ``metrics.json``, the log) but not its weights
    (``checkpoint.pt``, ``best.pt``: copies of them would double their bytes on a local artifact store); a
    resuming job's own folder (its config and log) under ``resumes/<folder name>``."""
    for path in sorted(output_dir.iterdir()):
        if path.is_dir():
            run.log_artifacts(path, path.name)
        elif path.name not in (checkpoint.FILE, checkpoint.BEST_FILE):
            run.client.log_artifact(run.run_id, str(path))
    if job_dir.resolve() != output_dir.resolve():
        run.log_artifacts(job_dir, f"resumes/{job_dir.name}")


def finish(run: RunLogger, output_dir: Path, keep: CheckpointKeep) -> None:
    """Close the run FINISHED, its tag ``best_weights`` naming its ``best.pt``, then delete its ``checkpoint.pt``
    unless ``keep`` is ``always``. Closed first: a stop in between leaves a FINISHED run's checkpoint (which
    nothing resumes), never an unfinished run without one."""
    best = output_dir / checkpoint.BEST_FILE
    run.set_tags({"best_weights": str(best.resolve())})
    run.finish("FINISHED")
    if keep is CheckpointKeep.always:
        return
    (output_dir / checkpoint.FILE).unlink(missing_ok=True)
    log.info("deleted %s (checkpoint.keep=last); the tested weights are in %s", output_dir / checkpoint.FILE, best)
