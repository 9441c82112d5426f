"""A sweep on SLURM (``hydra/launcher=submitit_slurm``), through submitit: the sweep's main process and its jobs.

The main process (:class:`SlurmLauncher`) submits the jobs as one job array, records their SLURM job ids in the sweep
folder (:data:`RECORD_FILE`), logs each beside its job and, as each ends, beside its run, and waits reading the jobs'
result files and SLURM's queue (``squeue``: submitit's ``sacct`` needs accounting, which many clusters lack, and it
warned at every poll there). A job SLURM ended before it finished (``scancel``, the time limit, a node's failure) has
its runs tagged ``slurm_state`` and the sweep ends 143: the same command again resumes it. A stop signal to the main
process cancels the jobs, which checkpoint. Started again, a sweep adopts the jobs an earlier command of it left
queued or running in SLURM (its process killed): it waits for them rather than submit them twice.

A job SLURM sends SIGTERM (``scontrol requeue``, a preemption, ``scancel``, the time limit) checkpoints, ends its run
KILLED and resumable, and ends without a result: SLURM starts it again, and it resumes its run from its own folder,
or the main process reports how SLURM ended it. Either way it is that job's stop alone, not the sweep's
(:func:`in_slurm_job`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf

from src.atomic import atomic_path, read_json_object
from src.jobs.stop_record import Stop, read_stop, write_stop
from src.parallel.preemption import EXIT_PREEMPTED, requeue_signal, signals_blocked
from src.tracking.identity import run_name

if TYPE_CHECKING:
    import mlflow

log = logging.getLogger(__name__)

LAUNCHER = "hydra_plugins.medsweep.SlurmLauncher"  # conf/hydra/launcher/submitit_slurm.yaml's: register_launcher()
RECORD_FILE = "slurm_jobs.json"  # in the sweep folder: each job's SLURM job id, for a command run again to adopt
JOB_TAG = "slurm_job_id"  # on a job's run: the SLURM job that trains it (``<array>_<task>``)
RESTARTS_TAG = "slurm_restarts"  # on a job's run: how many times SLURM had started that job again (a requeue)
STATE_TAG = "slurm_state"  # on a job's run: how SLURM ended a job that ended before it finished
REFUSED_TAG = "requeue_refused"  # on a job's run: why submitit did not requeue the job its timeout signal stopped
ACTIVE = frozenset(  # squeue's states of a job that is not over: it runs, or will (again)
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "SPECIAL_EXIT",
        "PREEMPTED",  # on its way to REQUEUED under PreemptMode=REQUEUE; ended under CANCEL, then purged
    }
)
QUEUE_CHECK_S = (2.0, 30.0)  # the first and the longest interval between two looks at SLURM's queue
RESULT_GRACE_S = 15.0  # how long an ended job's result file may lag behind its state (a shared file system)
EARLIER_SWEEPS = 50  # the unfinished sweeps of the experiment whose SLURM jobs a sweep started again may adopt


def in_slurm_job() -> bool:
    """Whether this process runs a job submitit submitted to SLURM: a stop signal there comes from SLURM and concerns
    this job alone (the sweep's main process runs elsewhere)."""
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm"


def slurm_job_id() -> str | None:
    """submitit's id of the SLURM job this process runs in: ``<array>_<task>`` for a job array's, else SLURM's."""
    if not in_slurm_job():
        return None
    from submitit.slurm.slurm import SlurmJobEnvironment

    return SlurmJobEnvironment().job_id


def run_tags() -> dict[str, str]:
    """A job's run's SLURM tags: its job id and how many times SLURM started it again; none outside SLURM."""
    job = slurm_job_id()
    return {} if job is None else {JOB_TAG: job, RESTARTS_TAG: os.environ.get("SLURM_RESTART_COUNT", "0")}


def queue_states(job_ids: Iterable[str]) -> dict[str, str] | None:
    """SLURM's state of each of ``job_ids`` its controller still lists (an ended job stays listed ``MinJobAge``, 300 s
    by default); None where ``squeue`` failed (the controller unreachable for a moment)."""
    job_ids = list(job_ids)
    arrays = sorted({job.split("_")[0] for job in job_ids})
    if not arrays:
        return {}
    try:
        result = subprocess.run(
            ["squeue", "-h", "-r", "--states=all", "-o", "%i|%T", "-j", ",".join(arrays)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:  # every job purged: "Invalid job id specified"
        return {} if "Invalid job id" in result.stderr else None
    listed = dict(line.split("|", 1) for line in result.stdout.split() if "|" in line)
    return {job: listed[job] for job in job_ids if job in listed}


def cancel(job_ids: Sequence[str]) -> None:
    """``scancel`` them: a running one is sent SIGTERM (it checkpoints) and killed after SLURM's ``KillWait``."""
    if job_ids:
        subprocess.run(["scancel", *job_ids], capture_output=True, timeout=60, check=False)


@dataclasses.dataclass
class Submitted:
    """One job of the sweep in SLURM: its number, overrides, submitit's handle and whether an earlier command of the
    sweep submitted it (adopted)."""

    num: int
    overrides: list[str]
    job: Any  # submitit.slurm.slurm.SlurmJob
    folder: str  # submitit's folder of the job (``%j``: its id)
    adopted: bool = False
    ended_at: float | None = None  # when SLURM's queue first showed it ended, its result file not there yet
    returned: JobReturn | None = None  # what the job returned (its objective)
    ended: str | None = None  # SLURM's state of a job that ended without a result
    failed: str | None = None  # the error of a job that failed outside medsweep's job (in submitit)

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def name(self) -> str:
        return run_name(self.overrides)

    def result_files(self) -> list[Path]:
        """Each task's result file (``tasks_per_node`` x ``nodes`` tasks: submitit's sub-jobs)."""
        return [self.job.task(k).paths.result_pickle for k in range(self.job.num_tasks)]

    def has_result(self) -> bool:
        return all(path.exists() for path in self.result_files())

    def collect(self) -> None:
        """Its result: what the job returned, or the error submitit recorded (a job that failed before medsweep's
        job code ran, or that submitit's own signal handler failed: its one line)."""
        try:
            self.returned = self.job.results()[0]
        except Exception as error:  # submitit's FailedJobError, UncompletedJobError
            lines = [line.strip() for line in str(error).splitlines()]
            said = [line for line in lines if line and not line.startswith(("-", "You can check", "or at paths"))]
            self.failed = f"{said[-1] if said else type(error).__name__} (log: {self.job.paths.stderr})"


@dataclasses.dataclass(frozen=True)
class Record:
    """A job a command of a sweep submitted, as :data:`RECORD_FILE` keeps it."""

    num: int
    overrides: list[str]  # Hydra's settings left out: the job's identity across commands
    job_id: str
    folder: str  # submitit's folder (``%j``: the job id)
    tasks: int


def read_records(sweep_dir: Path) -> list[Record]:
    """The jobs :data:`RECORD_FILE` of ``sweep_dir`` records; none where it is absent or not one medsweep wrote."""
    records, entries = [], read_json_object(sweep_dir / RECORD_FILE).get("jobs")
    for entry in entries if isinstance(entries, list) else []:
        with contextlib.suppress(TypeError, ValueError, KeyError):
            records.append(
                Record(
                    int(entry["num"]),
                    [str(o) for o in entry["overrides"]],
                    str(entry["job_id"]),
                    str(entry["folder"]),
                    int(entry["tasks"]),
                )
            )
    return records


def write_records(sweep_dir: Path, records: Iterable[Record]) -> None:
    with atomic_path(sweep_dir / RECORD_FILE) as path:
        path.write_text(json.dumps({"jobs": [dataclasses.asdict(record) for record in records]}, indent=1))


def register_launcher() -> None:
    """:class:`SlurmLauncher` among Hydra's plugins, as :data:`LAUNCHER`: Hydra instantiates a launcher only from the
    classes it found in the ``hydra_plugins`` package, by such a name; medsweep's lives in ``src`` (a job unpickles
    it from there)."""
    from hydra.core.plugins import Plugins

    Plugins.instance().class_name_to_class[LAUNCHER] = SlurmLauncher


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    """hydra-submitit-launcher's SLURM launcher, its jobs recorded, adopted, waited for and reported by medsweep (see
    the module's docstring); the same keys (``conf/hydra/launcher/submitit_slurm.yaml``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """The job, in SLURM: SLURM's signals wait (blocked) until the job's own handlers take them; one that comes
        after the job ended is dropped (a requeue would run a finished job again)."""
        signals = [signal.SIGTERM, requeue_signal() or signal.SIGUSR2]
        with signals_blocked(signals):
            result = super().__call__(*args, **kwargs)
            while late := signal.sigpending() & set(signals):
                log.warning("%s came after the job ended: ignored", signal.Signals(late.pop()).name)
                signal.sigtimedwait(signals, 0)
        return result

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import mlflow

        from src.tracking.store import tracking_uri

        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info("Submitit 'slurm' sweep output dir : %s", sweep_dir)
        wanted = {initial_job_idx + i: list(overrides) for i, overrides in enumerate(job_overrides)}
        client = mlflow.MlflowClient(tracking_uri(self.config))
        jobs = self.adopt(client, sweep_dir, wanted)
        jobs.update(self.submit(sweep_dir, {num: o for num, o in wanted.items() if num not in jobs}))
        records = {r.num: r for r in read_records(sweep_dir) if r.num not in jobs}
        for job in jobs.values():
            records[job.num] = Record(
                job.num, filter_overrides(job.overrides), job.job_id, job.folder, job.job.num_tasks
            )
        write_records(sweep_dir, sorted(records.values(), key=lambda r: r.num))
        self.wait(client, sweep_dir, jobs)
        self.report(client, sweep_dir, jobs)
        return [self.returned(jobs[num]) for num in sorted(wanted)]

    @property
    def folder(self) -> str:
        """submitit's folder of the jobs, absolute (``%j``: the job id)."""
        return str(Path(str(self.params["submitit_folder"])).absolute())

    def submit(self, sweep_dir: Path, wanted: dict[int, list[str]]) -> dict[int, Submitted]:
        """Submit ``wanted`` as one job array (one job alone as a job), as hydra-submitit-launcher 1.2 does."""
        if not wanted:
            return {}
        import submitit

        params = dict(self.params)
        init = {"folder": params.pop("submitit_folder")}
        if "max_num_timeout" in params:
            init["slurm_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster="slurm", **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{key if key in base else f"slurm_{key}": value for key, value in params.items()})
        state = Singleton.get_state()
        arguments = [(o, "hydra.sweep.dir", num, f"job_id_for_{num}", state) for num, o in wanted.items()]
        handles = executor.map_array(self, *zip(*arguments, strict=True))
        jobs = {}
        for (num, overrides), handle in zip(wanted.items(), handles, strict=True):
            jobs[num] = Submitted(num, overrides, handle, self.folder)
            log.info("\t#%d : %s -> SLURM job %s", num, " ".join(filter_overrides(overrides)), handle.job_id)
        return jobs

    def adopt(self, client: mlflow.MlflowClient, sweep_dir: Path, wanted: dict[int, list[str]]) -> dict[int, Submitted]:
        """The jobs an earlier command of this sweep (the same overrides, in this folder or in the folder of an
        unfinished sweep of the experiment) submitted and SLURM still runs or will: waited for, not submitted twice."""
        records = earlier_records(client, self.config.mlflow.experiment, sweep_dir)
        if not records:
            return {}
        states = queue_states(record.job_id for record in records)
        if states is None:
            log.warning("squeue failed: jobs an earlier command of this sweep left in SLURM may run twice")
            return {}
        alive = [record for record in records if states.get(record.job_id) in ACTIVE]
        import submitit

        jobs: dict[int, Submitted] = {}
        for num, overrides in wanted.items():
            key = filter_overrides(overrides)
            record = next((r for r in alive if r.overrides == key), None)
            if record is None:
                continue
            alive.remove(record)
            handle = submitit.SlurmJob(folder=record.folder, job_id=record.job_id, tasks=tuple(range(record.tasks)))
            jobs[num] = Submitted(num, overrides, handle, record.folder, adopted=True)
            log.info(
                "\t#%d : %s -> SLURM job %s (%s), submitted by an earlier command of this sweep: waited for, not "
                "submitted again",
                num,
                " ".join(key),
                record.job_id,
                states[record.job_id],
            )
        return jobs

    def wait(self, client: mlflow.MlflowClient, sweep_dir: Path, jobs: dict[int, Submitted]) -> None:
        """Until every job has its result (:meth:`Submitted.collect`) or SLURM ended it without one (its state in
        ``ended``). A stop record (a stop signal to this process, a failed job) cancels the jobs still queued, and the
        running ones too on a stop signal: they checkpoint."""
        waiting = dict(jobs)
        interval, next_look, stopping = QUEUE_CHECK_S[0], time.monotonic() + QUEUE_CHECK_S[0], False
        unreachable = False
        while waiting:
            for num, job in list(waiting.items()):
                if job.has_result():
                    del waiting[num]
                    job.collect()
                    self.log_end(client, job, "done" if job.failed is None else f"failed: {job.failed}")
            if not waiting:
                break
            if not stopping and (stop := read_stop(sweep_dir)) is not None:
                stopping = True
                self.stop(stop, list(waiting.values()))
                next_look = time.monotonic()
            if time.monotonic() >= next_look:
                states = queue_states(job.job_id for job in waiting.values())
                if states is None and not unreachable:
                    log.warning("squeue failed: waiting for the jobs' results, SLURM's queue looked at again later")
                unreachable = states is None
                for num, job in list(waiting.items()):
                    if states is None or states.get(job.job_id) in ACTIVE:
                        job.ended_at = None
                        continue
                    job.ended_at = job.ended_at or time.monotonic()
                    if time.monotonic() - job.ended_at >= RESULT_GRACE_S:
                        job.ended = states.get(job.job_id, "ENDED")  # ENDED: no longer listed (MinJobAge)
                        del waiting[num]
                        self.log_end(client, job, f"ended {job.ended} without a result")
                grace = any(job.ended_at for job in waiting.values())
                interval = QUEUE_CHECK_S[0] if grace else min(interval * 2, QUEUE_CHECK_S[1])
                next_look = time.monotonic() + interval
            time.sleep(1)

    def stop(self, stop: Stop, jobs: list[Submitted]) -> None:
        """The sweep stops: cancel its jobs SLURM has not started yet (they would start and train nothing), and on a
        stop signal (no failed job) the running ones too."""
        states = queue_states(job.job_id for job in jobs) or {}
        doomed = [job.job_id for job in jobs if stop.error is None or states.get(job.job_id) == "PENDING"]
        if doomed:
            log.warning("%s: cancelling SLURM jobs %s (a running one checkpoints)", stop.reason, " ".join(doomed))
            cancel(doomed)

    def log_end(self, client: mlflow.MlflowClient, job: Submitted, how: str) -> None:
        runs = ", ".join(f"run {run.info.run_id} {run.info.status}" for run in runs_of(client, self.config, job))
        log.info("job %d (%s): SLURM job %s %s: %s", job.num, job.name, job.job_id, how, runs or "no run of its own")

    def report(self, client: mlflow.MlflowClient, sweep_dir: Path, jobs: dict[int, Submitted]) -> None:
        """The adopted jobs' runs moved under this sweep's parent run; each job SLURM ended without a result has its
        runs tagged with SLURM's state (a run its end left RUNNING closed KILLED). Those and the jobs whose run stopped
        unfinished (KILLED: submitit did not requeue it) end the sweep as a stop, resumable (exit 143); a job that
        failed in submitit as a failed job (exit 1, its line)."""
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        from src.tracking.sweep import read_parent_id

        parent, unfinished, failed = read_parent_id(sweep_dir), [], []
        for num, job in sorted(jobs.items()):
            runs, what = runs_of(client, self.config, job), f"job {num} ({job.name}, SLURM job {job.job_id})"
            for run in runs:
                if job.adopted and parent and run.data.tags.get(MLFLOW_PARENT_RUN_ID) != parent:
                    client.set_tag(run.info.run_id, MLFLOW_PARENT_RUN_ID, parent)
                if job.ended is not None:
                    client.set_tag(run.info.run_id, STATE_TAG, job.ended)
                    if run.info.status == "RUNNING":
                        client.set_terminated(run.info.run_id, "KILLED")
            if job.failed is not None:
                failed.append(f"{what} failed in submitit: {job.failed}")
            elif job.ended is not None:
                unfinished.append(f"{what} ended {job.ended} before it finished")
            elif runs and runs[0].info.status == "KILLED":
                why = runs[0].data.tags.get(REFUSED_TAG, "")  # submitit's "Job not requeued because: <why>."
                unfinished.append(f"{what} stopped, not requeued ({why.rpartition(': ')[2].rstrip('.') or 'KILLED'})")
        if failed:
            write_stop(sweep_dir, Stop(f"{len(failed)} job(s) failed", 1, "; ".join(failed)))
        elif unfinished:
            write_stop(sweep_dir, Stop("; ".join(unfinished), EXIT_PREEMPTED))

    @staticmethod
    def returned(job: Submitted) -> JobReturn:
        """What the job returned; NaN for a job without a result (a failed trial to Optuna)."""
        if job.returned is not None:
            return job.returned
        return JobReturn(overrides=job.overrides, status=JobStatus.COMPLETED, _return_value=math.nan)


def runs_of(client: mlflow.MlflowClient, config: Any, job: Submitted) -> list[mlflow.entities.Run]:
    """The runs SLURM job ``job`` trained (more than one after an out-of-memory retry), the latest first."""
    from src.tracking.store import search_all

    experiment = client.get_experiment_by_name(config.mlflow.experiment)
    if experiment is None:
        return []
    found = search_all(client, experiment.experiment_id, f"tags.{JOB_TAG} = '{job.job_id}'")
    return sorted(found, key=lambda run: run.info.start_time, reverse=True)


def earlier_records(client: mlflow.MlflowClient, experiment: str, sweep_dir: Path) -> list[Record]:
    """The jobs recorded in ``sweep_dir`` (the same folder given again), then in the folders of the experiment's
    unfinished sweeps (a sweep whose process was killed stays RUNNING, or is closed KILLED), the latest first."""
    folders = [sweep_dir.resolve()]
    if found := client.get_experiment_by_name(experiment):
        sweeps = client.search_runs(
            [found.experiment_id],
            "tags.role = 'sweep' and attributes.status != 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=EARLIER_SWEEPS,
        )
        folders += [Path(run.data.tags["sweep_dir"]) for run in sweeps if run.data.tags.get("sweep_dir")]
    return [record for folder in dict.fromkeys(folders) for record in read_records(folder)]
