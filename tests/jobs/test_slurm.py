"""Sweeps through a real SLURM (``hydra/launcher=submitit_slurm``): a single-node slurmctld + slurmd with munge that the
tests start themselves, real jobs, real signals from the scheduler (``scontrol requeue``, ``scancel``, a time
limit), a real MLflow store in each test's temp dir."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import mlflow
import pytest
from omegaconf import OmegaConf

from src.cli import register
from src.jobs.job import in_sweep
from src.jobs.slurm import LAUNCHER, RECORD_FILE, SlurmLauncher, read_records, run_tags
from src.jobs.stop_record import read_stop
from src.parallel.preemption import PreemptedExit, Preemption
from src.training import checkpoint
from tests.helpers import ROOT, history, kill_group, run_cli, small_run, sweep_runs
from tests.jobs.helpers import as_sweep_job
from tests.report.helpers import tables

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel")
EPOCH_S = 900  # the longest wait for a job's event: minutes of work on a loaded machine; a hang fails there


class SlurmCluster:
    """A SLURM of its own in ``folder``: ``munged`` (its own key and socket), ``slurmctld`` and ``slurmd`` in the
    foreground as root (no systemd), their state, spool and logs in the folder, on free ports; one node, this host's
    short name with its CPUs, in partition ``debug``. Its clients find it through ``SLURM_CONF``. No accounting
    (``slurmdbd``): ``sacct`` fails on it, as on many small clusters."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        munge = self.folder / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket_path = munge / "munge.socket"
        self.daemon(
            "munged",
            "--foreground",
            "--force",
            f"--socket={socket_path}",
            f"--key-file={key}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
        )
        self.wait(socket_path.exists, "munged's socket")
        for name in ("state", "spool", "log"):
            (self.folder / name).mkdir()
        self.conf.write_text(self.config(socket_path))
        self.daemon("slurmctld", "-D", "-i")
        self.daemon("slurmd", "-D")
        self.wait(lambda: self.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() == "idle", "an idle node")

    def config(self, munge_socket: Path) -> str:
        host = socket.gethostname().split(".")[0]
        memory_mb = int(int(Path("/proc/meminfo").read_text().split()[1]) / 1024 * 0.8)
        return "\n".join(
            [
                "ClusterName=medsweep",
                f"SlurmctldHost={host}(127.0.0.1)",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={munge_socket},cred_expire=5",  # a requeued job may start again after 6 s, not 121
                f"StateSaveLocation={self.folder / 'state'}",
                f"SlurmdSpoolDir={self.folder / 'spool'}",
                f"SlurmctldPidFile={self.folder / 'slurmctld.pid'}",
                f"SlurmdPidFile={self.folder / 'slurmd.pid'}",
                f"SlurmctldLogFile={self.folder / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={self.folder / 'log' / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "MpiDefault=none",
                "ReturnToService=2",
                "SchedulerType=sched/backfill",
                "SchedulerParameters=sched_interval=2,bf_interval=2",  # a freed CPU taken in seconds
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "KillWait=30",
                "MinJobAge=300",
                f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={memory_mb} State=UNKNOWN",
                f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )

    def daemon(self, name: str, *args: str) -> None:
        log = (self.folder / f"{name}.out").open("w")
        self.daemons[name] = subprocess.Popen(
            [shutil.which(name), *args], env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def wait(self, ready: Callable[[], bool], what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, process in self.daemons.items():
                assert process.poll() is None, f"{name} exited with {process.returncode}:\n{self.logs()}"
            assert time.monotonic() < deadline, f"no {what} after {timeout} s:\n{self.logs()}"
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text()[-2000:]}" for path in sorted(self.folder.rglob("*.out")))

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        assert not check or result.returncode == 0, f"{' '.join(argv)}: {result.stderr}"
        return result

    def jobs(self) -> dict[str, str]:
        """Each job the controller lists, ended ones too: ``{job id: state}`` (an array's tasks one by one)."""
        listed = self.run("squeue", "-h", "-r", "--states=all", "-o", "%i|%T").stdout.split()
        return dict(line.split("|") for line in listed)

    def idle(self) -> None:
        """No job of an earlier test left: each cancelled, and gone from the node."""
        self.run("scancel", "--user=root", check=False)
        self.wait(lambda: not set(self.jobs().values()) & {"PENDING", "RUNNING", "COMPLETING"}, "end of the jobs")

    def stop(self) -> None:
        with contextlib.suppress(AssertionError, subprocess.SubprocessError):
            self.idle()
        for name in ("slurmd", "slurmctld", "munged"):
            if (process := self.daemons.get(name)) is None:
                continue
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_group(process)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """The session's SLURM (:class:`SlurmCluster`), ``SLURM_CONF`` in ``os.environ`` for the processes the tests
    start: each xdist worker starts its own (its folder, ports and munge socket), and two run side by side. Skipped
    where SLURM is not installed or this is not root, or where it cannot start; under ``CI=true`` (whose ``.ci/run``
    installs it) those fail."""
    missing = [name for name in PROGRAMS if shutil.which(name) is None]
    reason = f"{', '.join(missing)} not installed: apt-get install slurm-wlm munge" if missing else None
    if not reason and os.geteuid() != 0:
        reason = "a SLURM of the tests' own runs its daemons as root"
    fail = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
    if reason:
        fail(reason)
    with tempfile.TemporaryDirectory(prefix="medsweep-slurm-") as name:  # short: munge's socket path
        cluster = SlurmCluster(Path(name))
        started = time.monotonic()
        try:
            cluster.start()
        except AssertionError as err:
            cluster.stop()
            fail(f"the test cluster did not start: {err}")
        print(f"SLURM test cluster up in {time.monotonic() - started:.1f} s")
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("SLURM_CONF", str(cluster.conf))
                yield cluster
        finally:
            cluster.stop()


@pytest.fixture
def cluster(slurm: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session's SLURM with no job of an earlier test left, before and after the test."""
    slurm.idle()
    yield slurm
    slurm.idle()


@pytest.fixture
def popen() -> Iterator[Callable[..., subprocess.Popen]]:
    """``popen(*args)``: ``python -m src.train ARGS`` in a process group of its own, output in ``<log>``; the group
    killed at the test's end."""
    started = []

    def start(*args: str, log: Path) -> subprocess.Popen:
        with log.open("w") as out:
            started.append(
                subprocess.Popen(
                    [sys.executable, "-m", "src.train", *args],
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)},
                    start_new_session=True,
                )
            )
        return started[-1]

    yield start
    for process in started:
        kill_group(process)


def sweep(tmp_path: Path, store: str, shared_data: Path, *overrides: str, **launcher: object) -> tuple[str, ...]:
    """``-m`` on the test cluster's partition: 1 CPU and 2 GB a task, 10 minutes, unless ``launcher`` says otherwise
    (``hydra.launcher.<key>=<value>``)."""
    keys = {"partition": "debug", "timeout_min": 10, "cpus_per_task": 1, "mem_gb": 2, **launcher}
    settings = [f"hydra.launcher.{key}={value}" for key, value in keys.items()]
    return ("-m", "hydra/launcher=submitit_slurm", *settings, *small_run(tmp_path, store, shared_data, *overrides))


@pytest.fixture
def slurm_job_env(tmp_path, monkeypatch) -> Path:
    """This process as job 0 of a sweep in ``tmp_path`` that submitit ran as SLURM job 12_0."""
    for name, value in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "0"}.items():
        monkeypatch.setenv(name, value)
    as_sweep_job(tmp_path, monkeypatch)
    return tmp_path


def test_slurms_sigterm_mid_training_ends_the_job_alone_without_a_result(slurm_job_env):
    """SLURM's SIGTERM (``scontrol requeue``, a preemption, ``scancel``): the job used to write the sweep's stop record
    and return: SLURM's requeued job then found it and trained nothing, the sweep exited 143."""
    preemption = Preemption()

    def stopped() -> float:
        preemption.signum = signal.SIGTERM
        raise PreemptedExit(143)  # checkpointed, its run KILLED

    with pytest.raises(PreemptedExit):  # no result: submitit writes none, SLURM starts the job again or ends it
        in_sweep(OmegaConf.create(), stopped, preemption)
    assert read_stop(slurm_job_env) is None
    assert run_tags() == {"slurm_job_id": "12_0", "slurm_restarts": "0"}


@pytest.mark.parametrize("refused", [None, "Job not requeued because: timed-out too many times."])
def test_a_slurm_jobs_signal_after_training_or_a_refused_requeue_leaves_the_sweep_going(slurm_job_env, refused):
    """A SIGTERM that came after the training loop (the job finished its test), or submitit's timeout signal it would
    not requeue: the job returns (NaN for the stopped one); no stop record, the sweep's main process reports it."""
    preemption = Preemption()

    def job() -> float:
        preemption.signum, preemption.refused = (signal.SIGUSR2, refused) if refused else (signal.SIGTERM, None)
        if refused:
            raise PreemptedExit(143)
        return 0.9

    result = in_sweep(OmegaConf.create(), job, preemption)
    assert math.isnan(result) if refused else result == 0.9
    assert read_stop(slurm_job_env) is None


@pytest.mark.parametrize(
    "text",
    ["", "{", "[]", '{"jobs": 3}', '{"jobs": [{"num": "x"}]}', '{"jobs": [{"num": 0}]}', "\udcff", "null"],
    ids=["empty", "cut", "list", "not-a-list", "bad-num", "missing-keys", "bad-utf8", "null"],
)
def test_a_damaged_job_record_adopts_nothing(tmp_path, text):
    """``slurm_jobs.json`` not as a sweep wrote it (cut short, edited): no job to adopt, the sweep submits its own."""
    (tmp_path / RECORD_FILE).write_text(text, errors="surrogateescape")
    assert read_records(tmp_path) == []


def test_the_slurm_preset_names_medsweeps_launcher_among_hydras_plugins():
    """Hydra instantiates a launcher only from its plugin registry, by a ``hydra_plugins.`` name."""
    from hydra.core.plugins import Plugins

    register()
    target = OmegaConf.load(ROOT / "conf" / "hydra" / "launcher" / "submitit_slurm.yaml")["_target_"]
    assert target == LAUNCHER and Plugins.instance().class_name_to_class[LAUNCHER] is SlurmLauncher


def wait_until(ready: Callable[[], bool], process: subprocess.Popen, log: Path, what: str) -> None:
    """Poll ``ready`` until it holds; fails when the sweep's process ``process`` ended first, or after ``EPOCH_S``."""
    deadline = time.monotonic() + EPOCH_S
    while not ready():
        ended = process.poll()
        assert ended is None, f"the sweep ended ({ended}) before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {EPOCH_S} s"
        time.sleep(0.2)


def checkpointed(folder: Path, epochs: int) -> Callable[[], bool]:
    """Whether ``folder``'s checkpoint holds ``epochs`` finished epochs (``checkpoint.every_s=0``: each epoch's)."""

    def ready() -> bool:
        path = folder / checkpoint.FILE
        with contextlib.suppress(OSError, checkpoint.Unreadable, EOFError, RuntimeError, KeyError):
            return path.is_file() and checkpoint.load(path, mmap=True)["epoch"] >= epochs
        return False

    return ready


def recorded(sweep_dir: Path) -> dict[int, str]:
    """The SLURM job id of each job of the sweep, as its folder records it."""
    return {record.num: record.job_id for record in read_records(sweep_dir)}


def slurm_job(sweep_dir: Path, num: int) -> str:
    """The SLURM job id submitit ran job ``num`` of the sweep as (``<array>_<task>`` in a job array): its folder's
    name, whatever records it."""
    (folder,) = [path.name for path in (sweep_dir / ".submitit").iterdir() if path.name.endswith(f"_{num}")]
    return folder


def job_log(sweep_dir: Path, job: str, task: int = 0) -> str:
    """What SLURM job ``job``'s task printed, every start of it (submitit appends)."""
    return (sweep_dir / ".submitit" / job / f"{job}_{task}_log.out").read_text()


def epochs_logged(uri: str, run_id: str) -> list[int]:
    """The steps of the run's ``train/loss``: one per epoch trained and logged."""
    return [step for step, _ in history(uri, run_id)["train/loss"]]


def by_seed(jobs: list[mlflow.entities.Run]) -> dict[str, mlflow.entities.Run]:
    """The runs of a sweep over ``seed``, one per seed (a second run of a seed fails here)."""
    found = {}
    for run in jobs:
        assert run.data.params["seed"] not in found, f"two runs of seed {run.data.params['seed']}"
        found[run.data.params["seed"]] = run
    return found


def timed(what: str, started: float) -> None:
    print(f"{what}: {time.monotonic() - started:.1f} s")


@pytest.mark.slow
def test_a_sweep_runs_each_job_once_a_requeued_one_resumes_and_the_log_names_each_slurm_job(
    tmp_path, store, shared_data, cluster, popen
):
    """Two jobs, one of them requeued by ``scontrol requeue`` (what ``PreemptMode=REQUEUE`` does too) once it trained
    an epoch: SLURM sends it SIGTERM, ends it and starts it again. It used to end its run KILLED and write the sweep's
    stop record: the sweep exited 143 ("SIGTERM stopped the sweep") and the job, started again, trained nothing ("job
    0 not started"). submitit's ``sacct`` warned at every poll on this cluster (no accounting)."""
    started, log = time.monotonic(), tmp_path / "sweep.log"
    args = sweep(tmp_path, store, shared_data, "epochs=4", "limit_batches=4", "checkpoint.every_s=0", "seed=0,1")
    process = popen(*args, log=log)
    folder = tmp_path / "sweep" / "0"
    wait_until(checkpointed(folder, 1), process, log, "job 0's first epoch")
    job = slurm_job(tmp_path / "sweep", 0)
    cluster.run("scontrol", "requeue", job)
    assert process.wait(timeout=EPOCH_S) == 0, log.read_text()[-3000:]
    timed("a sweep of 2 jobs, one requeued", started)

    parents, jobs = sweep_runs(store)
    assert [p.info.status for p in parents] == ["FINISHED"]
    runs = by_seed(jobs)  # one run per config
    assert {seed: r.info.status for seed, r in runs.items()} == {"0": "FINISHED", "1": "FINISHED"}
    assert {r.data.tags["mlflow.parentRunId"] for r in jobs} == {parents[0].info.run_id}
    requeued = runs["0"]
    assert requeued.data.tags["resumes"] == "1" and requeued.data.tags["slurm_restarts"] == "1"
    assert epochs_logged(store, requeued.info.run_id) == [0, 1, 2, 3]  # each epoch trained and logged once
    printed = job_log(tmp_path / "sweep", job)
    assert printed.count("epoch 1/4") == 1 and f"resuming run {requeued.info.run_id}" in printed

    text = log.read_text()
    ids = recorded(tmp_path / "sweep")
    assert ids[0] == job and {r.data.tags["slurm_job_id"] for r in jobs} == set(ids.values())
    for seed, run in runs.items():  # each job's SLURM job beside its run, in the sweep's log
        assert f"SLURM job {run.data.tags['slurm_job_id']} done: run {run.info.run_id} FINISHED" in text, seed
    assert "sacct" not in text and "Bypassing" not in text
    warnings = [line.split("]", 1)[-1] for line in text.splitlines() if "WARNING" in line]
    assert len(warnings) == len(set(warnings)), warnings  # no warning said twice

    report = run_cli(f"sweep={tmp_path / 'sweep'}", module="src.report")
    assert report.returncode == 0, report.stderr[-3000:]
    (row,) = tables((tmp_path / "sweep" / "report" / "report.md").read_text())["Configurations"]
    assert row["n"] == "2"  # both seeds of the one configuration


def job_field(cluster: SlurmCluster, job: str, field: str) -> str:
    """``field`` of ``scontrol show job``'s line of ``job`` (``RunTime``, ``Restarts``, ``JobState`` ...)."""
    line = cluster.run("scontrol", "show", "job", "-o", job).stdout
    return next(part.split("=", 1)[1] for part in line.split() if part.startswith(f"{field}="))


def reach_time_limit(cluster: SlurmCluster, job: str, after_s: float) -> None:
    """Give ``job`` a time limit (``scontrol update``, as an administrator may) that ends it ``after_s`` seconds from
    now at most and a minute less at least: with ``signal_delay_s=120`` SLURM sends it submitit's signal at its next
    look at the jobs' limits (every 30 s)."""
    days, _, clock = job_field(cluster, job, "RunTime").rpartition("-")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    elapsed = (int(days or 0) * 24 + hours) * 3600 + minutes * 60 + seconds
    cluster.run("scontrol", "update", f"JobId={job}", f"TimeLimit={math.ceil((elapsed + after_s) / 60) - 1}")


@pytest.mark.slow
def test_a_job_at_its_time_limit_is_requeued_by_submitit_then_stops_resumable_and_the_same_command_finishes_it(
    tmp_path, store, shared_data, cluster, popen
):
    """SLURM sends submitit's signal (USR2) ``signal_delay_s=120`` before a job's time limit (``timeout_min``): the job
    checkpoints and submitit requeues it while ``max_num_timeout=1`` allows, and it resumes its run; its next time
    limit comes once too often: submitit does not requeue it, its run ends KILLED and resumable, tagged why, the
    sweep 143 naming it; the same command again finishes it. The limits are reached at known points: once the job
    trained an epoch its limit is lowered to end within 2 minutes, and the requeued job is given 2 minutes."""
    started, log, sweep_dir = time.monotonic(), tmp_path / "sweep.log", tmp_path / "sweep"
    # 16 epochs of 24 steps: the job must outlast two of SLURM's 30-s looks at its limits after its first epoch, on a
    # quiet machine too (16 epochs of 4 steps finished before the first)
    overrides = ("epochs=16", "limit_batches=24", "checkpoint.every_s=0", "seed=0")
    args = sweep(tmp_path, store, shared_data, *overrides, signal_delay_s=120, max_num_timeout=1)
    process = popen(*args, log=log)
    wait_until(checkpointed(sweep_dir / "0", 1), process, log, "the job's first epoch")
    (job,) = recorded(sweep_dir).values()
    reach_time_limit(cluster, job, after_s=120)
    wait_until(lambda: job_field(cluster, job, "Restarts") == "1", process, log, "submitit's requeue")
    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=2")  # requeued, not started again yet
    assert process.wait(timeout=EPOCH_S) == 143, log.read_text()[-3000:]
    timed("a job requeued at its time limit, then stopped at the next", started)
    printed = job_log(sweep_dir, job)
    signalled = [line for line in printed.splitlines() if line.startswith("submitit WARNING") and "SIGUSR2" in line]
    assert len(signalled) == 2 and printed.count(f"Requeued job {job} (0 remaining timeouts)") == 2  # and its echo
    assert "Job not requeued because: timed-out too many times" in printed
    said = f"SLURM job {job}) stopped, not requeued (timed-out too many times): finished jobs are kept"
    assert said in log.read_text()
    (_, (stopped,)) = sweep_runs(store)
    assert (stopped.info.status, stopped.data.tags["slurm_restarts"]) == ("KILLED", "1")
    assert stopped.data.tags["resume_with"] == f"resume={stopped.info.run_id}"

    again = run_cli(*args)
    timed("the same command again", started)
    assert again.returncode == 0, again.stderr[-3000:]
    parents, (run,) = sweep_runs(store)
    assert sorted(parent.info.status for parent in parents) == ["FINISHED", "KILLED"]
    assert run.info.run_id == stopped.info.run_id and run.info.status == "FINISHED"
    assert epochs_logged(store, run.info.run_id) == list(range(16))  # no epoch trained twice
    print(f"time limit: requeued once, stopped once, {int(run.data.tags['resumes'])} resumes, 16 epochs, 1 run")


@pytest.mark.slow
def test_scancel_of_a_job_and_of_the_sweep_ends_their_runs_resumable_and_the_same_command_resumes_them(
    tmp_path, store, shared_data, cluster, popen
):
    """``scancel`` of one running job: it checkpoints, its run ends KILLED, and the sweep goes on (the next job takes
    its place); then ``scancel`` of the whole job array (a running job, one starting): the sweep ends 143 naming each,
    their runs tagged ``slurm_state=CANCELLED``. Without accounting, submitit waited for ever for a cancelled job."""
    started, log = time.monotonic(), tmp_path / "sweep.log"
    overrides = ("epochs=5", "limit_batches=4", "checkpoint.every_s=0", "seed=0,1,2")
    args = sweep(tmp_path, store, shared_data, *overrides, array_parallelism=2)
    process = popen(*args, log=log)
    sweep_dir = tmp_path / "sweep"
    wait_until(checkpointed(sweep_dir / "0", 1), process, log, "job 0's first epoch")
    ids = recorded(sweep_dir)
    cluster.run("scancel", ids[0])
    wait_until(lambda: cluster.jobs().get(ids[2]) == "RUNNING", process, log, "job 2 in job 0's place")
    cluster.run("scancel", ids[0].split("_")[0])  # the whole job array: job 2 starting, job 1 most likely training
    assert process.wait(timeout=EPOCH_S) == 143, log.read_text()[-3000:]
    timed("a sweep cancelled", started)
    text = log.read_text()
    for num in (0, 2):
        assert f"SLURM job {ids[num]} ended CANCELLED without a result" in text, num  # as it ended
        assert f"SLURM job {ids[num]}) ended CANCELLED before it finished" in text, num  # in the sweep's last line
    assert "finished jobs are kept, stopped ones are resumable: the same command again resumes the sweep" in text
    _, jobs = sweep_runs(store)
    stopped = {seed: run for seed, run in by_seed(jobs).items() if run.info.status != "FINISHED"}
    assert "0" in stopped and all(seed != "2" or run.info.status != "FINISHED" for seed, run in by_seed(jobs).items())
    for seed, run in stopped.items():
        assert (run.info.status, run.data.tags["slurm_state"]) == ("KILLED", "CANCELLED"), seed
        assert run.data.tags["resume_with"] == f"resume={run.info.run_id}"
    print(f"scancel: runs stopped {sorted(stopped)}, SLURM jobs cancelled: 0 alone, then the array")

    again = run_cli(*args)
    timed("the same command again", started)
    assert again.returncode == 0, again.stderr[-3000:]
    _, jobs = sweep_runs(store)
    runs = by_seed(jobs)
    assert {seed: run.info.status for seed, run in runs.items()} == {"0": "FINISHED", "1": "FINISHED", "2": "FINISHED"}
    for seed, run in stopped.items():  # resumed, not trained anew
        assert runs[seed].info.run_id == run.info.run_id and runs[seed].data.tags["resumes"] == "1", seed
    for run in runs.values():
        assert epochs_logged(store, run.info.run_id) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_the_same_command_after_the_sweeps_process_was_killed_waits_for_its_jobs_in_slurm_rather_than_submit_them(
    tmp_path, store, shared_data, cluster, popen
):
    """The sweep's process SIGKILLed (a login node's session gone) while job 0 runs and job 1 waits behind
    ``array_parallelism=1``: the same command again, in a new sweep folder (the default's is new at each command),
    adopts both SLURM jobs from the first folder's record and waits for them: nothing submitted twice, one run per
    config under the new sweep's parent run. Job 0 is suspended (``scontrol suspend``) until then: it would finish
    first on a fast machine. The array ran one job at a time, though the node has 2 CPUs."""
    started, log, again_log = time.monotonic(), tmp_path / "first.log", tmp_path / "again.log"
    overrides = ("epochs=3", "limit_batches=3", "checkpoint.every_s=0", "seed=0,1")
    args = sweep(tmp_path, store, shared_data, *overrides, array_parallelism=1)
    process = popen(*args, log=log)
    wait_until(checkpointed(tmp_path / "sweep" / "0", 1), process, log, "job 0's first epoch")
    ids = recorded(tmp_path / "sweep")
    cluster.run("scontrol", "suspend", ids[0])
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = cluster.jobs()
    assert [before[ids[0]], before[ids[1]]] == ["SUSPENDED", "PENDING"]  # job 1 behind job 0

    again = popen(
        *[f"hydra.sweep.dir={tmp_path}/again" if a.startswith("hydra.sweep.dir=") else a for a in args], log=again_log
    )
    adopted = "submitted by an earlier command of this sweep: waited for, not submitted again"
    wait_until(lambda: again_log.read_text().count(adopted) == 2, again, again_log, "both jobs adopted")
    cluster.run("scontrol", "resume", ids[0])
    assert again.wait(timeout=EPOCH_S) == 0, again_log.read_text()[-3000:]
    timed("a sweep killed, then the same command", started)
    text = again_log.read_text()
    assert (
        f"-> SLURM job {ids[0]} (SUSPENDED), {adopted}" in text
        and f"-> SLURM job {ids[1]} (PENDING), {adopted}" in text
    )
    assert not set(cluster.jobs()) - set(before)  # no job submitted again
    parents, jobs = sweep_runs(store)
    runs = by_seed(jobs)
    assert {seed: run.info.status for seed, run in runs.items()} == {"0": "FINISHED", "1": "FINISHED"}
    first, second = sorted(parents, key=lambda run: run.info.start_time)
    assert (first.info.status, first.data.tags["status"], second.info.status) == ("KILLED", "process_gone", "FINISHED")
    assert {run.data.tags["mlflow.parentRunId"] for run in jobs} == {second.info.run_id}
    spans = sorted((run.info.start_time, run.info.end_time) for run in jobs)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False)), spans  # 1 at a time


@pytest.mark.slow
def test_a_ddp_job_of_two_slurm_tasks_forms_one_process_group_and_logs_one_run(tmp_path, store, shared_data, cluster):
    """``tasks_per_node=2``: SLURM starts the job's two tasks, which join one gloo process group from SLURM's variables
    (through submitit's); rank 0 logs the one run."""
    started = time.monotonic()
    overrides = ("parallel=ddp", "epochs=2", "limit_batches=2", "seed=0")
    result = run_cli(*sweep(tmp_path, store, shared_data, *overrides, tasks_per_node=2))
    timed("a DDP job of 2 tasks", started)
    assert result.returncode == 0, result.stderr[-3000:]
    (_, (run,)) = sweep_runs(store)
    assert (run.info.status, run.data.params["world_size"]) == ("FINISHED", "2")
    assert all(len(points) == len({step for step, _ in points}) for points in history(store, run.info.run_id).values())
    job = run.data.tags["slurm_job_id"]
    for task in (0, 1):
        printed = job_log(tmp_path / "sweep", job, task)
        assert f"global_rank={task}(2)" in printed and f"rank {task}/2 on cpu" in printed, printed[-2000:]
