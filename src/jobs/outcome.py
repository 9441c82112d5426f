"""How a job ends: skipped (a FINISHED run has its config, or a live process trains it), stopped before its run
(a stop signal during start-up), out of memory (its run FAILED with ``status=oom``, maybe retried at half the
micro-batch), diverged (FAILED, ``status=diverged``), out of disk space (FAILED, ``status=no_space``, resumable),
preempted (its run KILLED and resumable), or FINISHED (its artifacts logged, its checkpoint deleted unless
``checkpoint.keep=always``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import mlflow

from src.atomic import NoSpace, is_temporary
from src.config import CheckpointKeep, Config
from src.errors import UsageError
from src.folders import LOCK_FILE
from src.jobs.plan import Plan
from src.jobs.slurm import REFUSED_TAG
from src.parallel.preemption import Preempted, PreemptedExit, Preemption
from src.perf.autobatch import one_sample_fails
from src.perf.memory import predict
from src.tracking.identity import code_fingerprint
from src.tracking.runs import RunLogger
from src.tracking.store import (
    STORE_ERRORS,
    StoreGone,
    best_metric,
    innermost_reason,
    redacted,
    sqlite_path,
    went_away,
)
from src.tracking.sweep import SKIPPED_TAG, job_parent_id
from src.training import checkpoint
from src.training.trainer import Diverged

log = logging.getLogger(__name__)


def skip(plan: Plan) -> float:
    """Train nothing: log why, list the job on the sweep's parent run, return the finished run's objective (NaN for
    a run a live process trains: :func:`src.jobs.resume.resumable` logged it)."""
    client = mlflow.MlflowClient(plan.tracking_uri)
    if plan.busy:
        list_on_parent(client, plan, plan.busy)  # another command trains it: the sweep's report finds it once FINISHED
        return float("nan")
    done = plan.finished
    same = "config" if plan.cfg.skip_finished == "config" else f"config and code_fingerprint {code_fingerprint()}"
    log.info("skipping %s: run %s FINISHED with the same %s", plan.run_name, done.info.run_id, same)
    list_on_parent(client, plan, done.info.run_id)
    return best_metric(client, done.info.run_id, plan.cfg.objective)


def list_on_parent(client: mlflow.MlflowClient, plan: Plan, run_id: str) -> None:
    """In a sweep, tag its parent run ``skipped.<job>`` = ``<overrides> -> <run_id>``: the run that stands for this
    job, which trained nothing (``src.report`` reads the FINISHED runs these tags name)."""
    if parent_id := job_parent_id():
        RunLogger(client, parent_id).set_tags(
            {f"{SKIPPED_TAG}{plan.job_num}": f"{' '.join(plan.overrides)} -> {run_id}"}
        )


def halved(cfg: Config) -> Config | None:
    """The attempt after ``cfg`` ran out of memory: half the micro-batch and twice the accumulation (the same effective
    batch), while ``oom_retry`` allows; None below one sample, or at one sample where BatchNorm cannot train on it."""
    if not (cfg.oom_retry and cfg.batch_size > 1):
        return None
    half = dataclasses.replace(cfg, batch_size=cfg.batch_size // 2, accumulate=cfg.accumulate * 2)
    return None if one_sample_fails(half) else half


def attempts(cfg: Config) -> Iterator[Config]:
    """The config, then :func:`halved` after each out-of-memory attempt, while there is one."""
    attempt: Config | None = cfg
    while attempt is not None:
        yield attempt
        attempt = halved(attempt)


def read_oom(output_dir: Path) -> dict[str, float] | None:
    """The memory reached by the ranks that ran out of memory (their ``oom_rank<k>.json``), consumed."""
    records = sorted(output_dir.glob("oom_rank*.json"))
    if not records:
        return None
    peaks = [json.loads(path.read_text())["mem/peak_mb"] for path in records]
    for path in records:
        path.unlink()
    return {"mem/peak_mb": max(peaks)}


def read_diverged(output_dir: Path) -> Diverged | None:
    """The divergence of the first rank that diverged (its ``diverged_rank<k>.txt``), consumed."""
    records = sorted(output_dir.glob("diverged_rank*.txt"))
    if not records:
        return None
    first = Diverged(records[0].read_text())
    for path in records:
        path.unlink()
    return first


def stop_before_run(preemption: Preemption) -> None:
    """A stop signal that came during start-up ends the job before its run is created: nothing to resume; submitit's
    requeue signal goes back to submitit (it requeues the job, which starts anew)."""
    if preemption.requested:
        log.warning(
            "stopped (%s) before its run was created: nothing to resume", signal.Signals(preemption.signum).name
        )
        handed_over(preemption)


def failed(run: RunLogger, cfg: Config, plan: Plan, error: BaseException) -> bool:
    """Close the run of a failed attempt, FAILED (KILLED and resumable on a second Ctrl-C, exit 130). Out of
    memory: tagged ``status=oom`` and whether it is retried; True to retry (``oom_retry``). Out of memory without a
    retry, or diverged (``status=diverged``): False in a sweep (it goes on), a :class:`UsageError` for a single run.
    Out of disk space (``status=no_space``, resumable): a :class:`UsageError` with the resume command. A failing
    MLflow store (the error, or what closing the run met) is a :class:`UsageError` naming the run to resume. Any
    other error is raised again."""
    try:
        return closed_failed(run, cfg, plan, error)
    except (*STORE_ERRORS, StoreGone) as broken:
        store, path = redacted(plan.tracking_uri), sqlite_path(plan.tracking_uri)
        if path is not None and not path.exists():  # SQLite wrote on into the deleted file, then refused
            raise UsageError(
                f"the MLflow store {store} lost its file while run {run.run_id} trained (deleted or moved): put "
                f"{path} back, then resume it: python -m src.train resume={run.run_id}; in a new store the same "
                "command trains it anew"
            ) from None
        if went_away(broken):  # the run stays RUNNING there; the next command finds its process gone and resumes it
            raise UsageError(
                f"the MLflow store {store} went away ({store_failure(broken)}) while run {run.run_id} trained; "
                f"{go_on(run, plan.output_dir, 'start the store again', ' (or the same command again)')}"
            ) from None
        raise UsageError(
            f"the MLflow store {store} failed ({store_failure(broken)}) with run {run.run_id}, which may "
            f"stay RUNNING; {go_on(run, plan.output_dir, 'fix the store', ' (or the same command again)')}"
        ) from None


def go_on(run: RunLogger, output_dir: Path, fix: str, also: str = "") -> str:
    """How a run that failed for ``fix``'s want goes on: resumed from its checkpoint, or trained anew where it wrote
    none yet."""
    if (output_dir / checkpoint.FILE).is_file():
        return f"its last checkpoint is kept: {fix}, then resume it: python -m src.train resume={run.run_id}{also}"
    return f"it wrote no checkpoint yet: {fix}, then run the same command again (a new run trains it)"


def store_failure(error: BaseException) -> str:
    """What a store error says, in a few words: a full disk as such."""
    text = innermost_reason(error)
    full = any(sign in text for sign in ("database or disk is full", "no space left"))
    return "no space left on its disk" if full else text[:200]


def closed_failed(run: RunLogger, cfg: Config, plan: Plan, error: BaseException) -> bool:
    oom, diverged = read_oom(plan.output_dir), read_diverged(plan.output_dir)
    error = diverged if diverged and not isinstance(error, Diverged) else error  # DDP: a spawned rank's
    if isinstance(error, (*STORE_ERRORS, StoreGone)):  # StoreGone: a rank's check of the store found it gone
        if not went_away(error):  # a store that went away cannot close it: one more call would wait out its retries
            with contextlib.suppress(*STORE_ERRORS):
                run.finish("FAILED")
        raise error
    if isinstance(error, KeyboardInterrupt):  # a second Ctrl-C: no step checkpoint, the last one is kept
        stopped_at_once(run, plan.output_dir)
    if isinstance(error, NoSpace):
        run.set_tags({"status": "no_space", "resume_with": f"resume={run.run_id}"})
        run.finish("FAILED")
        raise UsageError(f"{error}: run {run.run_id} FAILED; {go_on(run, plan.output_dir, 'free space')}") from None
    if isinstance(error, Diverged):
        run.set_tags({"status": "diverged"})
        run.finish("FAILED")
        return config_failed(plan, run, f"training diverged: {error}", "lower optim.lr, set grad_clip, or amp=false")
    if oom is None:
        run.finish("FAILED")
        raise error
    retry = halved(cfg) is not None  # the rule attempts() follows: a retry announced is one that runs
    run.set_tags({"status": "oom", "retried": str(retry).lower()})
    run.log_metrics({**oom, "mem/predicted_mb": predict(cfg, plan.execution).total_mb}, step=0)
    run.finish("FAILED")
    message = f"out of memory at batch_size={cfg.batch_size} (peak {oom['mem/peak_mb']:.0f} MiB)"
    if retry:
        log.warning("%s: retrying with batch_size=%d accumulate=%d", message, cfg.batch_size // 2, cfg.accumulate * 2)
        return True
    return config_failed(plan, run, message, "lower batch_size, or set oom_retry=true")


def close_resumable(run: RunLogger) -> None:
    """End a stopped run whose checkpoint holds its last epoch: KILLED, tagged ``preempted=true`` (the sweep it stopped
    is resumable too) and with the ``resume_with`` override that resumes it."""
    run.set_tags({"preempted": "true", "resume_with": f"resume={run.run_id}"})
    run.finish("KILLED")


def stopped_at_once(run: RunLogger, output_dir: Path) -> NoReturn:
    """A second Ctrl-C stopped the job between checkpoints (never inside one: :func:`src.atomic.uninterrupted`): its
    run ends KILLED, resumable from its last checkpoint and tagged so (``preempted=true``: the sweep it stopped is
    resumable too), exit 130. Before its first checkpoint the run holds no epoch (an epoch is logged once a checkpoint
    holds it) and is deleted: the same command trains the config in a run of its own, none left beside it."""
    if (output_dir / checkpoint.FILE).is_file():
        close_resumable(run)
        log.warning(
            "stopped at once: run %s is KILLED and resumable from its last checkpoint: python -m src.train resume=%s "
            "(or the same command again)",
            run.run_id,
            run.run_id,
        )
    else:
        run.finish("KILLED")
        run.client.delete_run(run.run_id)
        log.warning(
            "stopped at once before its first checkpoint: run %s deleted, nothing to resume (the same command "
            "trains the config anew)",
            run.run_id,
        )
    raise PreemptedExit(128 + signal.SIGINT) from None


def config_failed(plan: Plan, run: RunLogger, message: str, fix: str) -> bool:
    """A sweep goes on after a job whose config cannot train (False); a single run stops with one line."""
    if not plan.multirun:
        raise UsageError(f"{message} (run {run.run_id} FAILED): {fix}") from None
    log.error("%s: run %s FAILED; the sweep goes on", message, run.run_id)
    return False


def stop_preempted(run: RunLogger, stop: Preempted, preemption: Preemption) -> NoReturn:
    """A stop signal was honoured and the checkpoint written: the run ends KILLED, tagged resumable; submitit's requeue
    signal goes back to submitit (it requeues the job, which resumes by itself); else exit 128 + the signal."""
    preemption.begin("closing the stopped run")
    close_resumable(run)
    log.warning(
        "preempted (%s): run %s is KILLED and resumable: python -m src.train resume=%s (or the same command again)",
        stop,
        run.run_id,
        run.run_id,
    )
    handed_over(preemption, run)


def handed_over(preemption: Preemption, run: RunLogger | None = None) -> NoReturn:
    """End the stopped job: submitit's requeue signal goes back to submitit, which requeues the job and exits (its code
    tells its controller so) or refuses (the run, if any, tagged why); else exit 128 + the signal."""
    try:
        preemption.hand_over()
    except SystemExit as handed:
        raise PreemptedExit(handed.code) from None
    if preemption.refused is not None and run is not None:
        run.set_tags({REFUSED_TAG: preemption.refused})
    raise PreemptedExit(preemption.exit_code)


def log_outputs(run: RunLogger, output_dir: Path, job_dir: Path) -> None:
    """The run's folder as artifacts (``.hydra/``, ``eval/``, ``metrics.json``, the log) but not its weights
    (``checkpoint.pt``, ``best.pt``: copies of them would double their bytes on a local artifact store); a
    resuming job's own folder (its config and log) under ``resumes/<folder name>``."""
    for path in sorted(output_dir.iterdir()):
        if path.name == LOCK_FILE or is_temporary(path):
            continue
        if path.is_dir():
            run.log_artifacts(path, path.name)
        elif path.name not in (checkpoint.FILE, checkpoint.BEST_FILE):
            run.client.log_artifact(run.run_id, str(path))
    if job_dir.resolve() != output_dir.resolve():
        run.log_artifacts(job_dir, f"resumes/{job_dir.name}")


def finish(run: RunLogger, output_dir: Path, keep: CheckpointKeep, preemption: Preemption) -> None:
    """Close the run FINISHED, its tag ``best_weights`` naming its ``best.pt``, then delete its ``checkpoint.pt``
    unless ``keep`` is ``always``. Closed first: a stop in between leaves a FINISHED run's checkpoint (which
    nothing resumes), never an unfinished run without one. A stop signal that came after the training loop let the
    test end first; a signal from now on does not interrupt the close."""
    preemption.begin("closing the finished run")
    best = output_dir / checkpoint.BEST_FILE
    run.set_tags({"best_weights": str(best.resolve())})
    run.finish("FINISHED")
    if preemption.requested:
        log.warning(
            "%s came after training: run %s finished its test first", signal.Signals(preemption.signum).name, run.run_id
        )
    if keep is CheckpointKeep.always:
        return
    (output_dir / checkpoint.FILE).unlink(missing_ok=True)
    log.info("deleted %s (checkpoint.keep=last); the tested weights are in %s", output_dir / checkpoint.FILE, best)
