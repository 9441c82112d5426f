"""src/jobs/dry_run.py: ``dry_run=true`` prints one line per job and a total from real processes against a real SQLite
store, which it leaves byte for byte as it was; each job shape timed once."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import re
import statistics
from pathlib import Path

import mlflow
import pytest

from src.execution import validate
from src.jobs.dry_run import Rate, job_seconds, spans
from src.jobs.dry_run_total import rounded
from src.jobs.resume import Resume
from src.perf import step_timing
from src.perf.autobatch import CPU_HEADROOM, largest_predicted
from src.perf.memory import predict
from src.perf.probe_cache import now
from src.tracking.identity import config_hash, flatten, run_name
from src.training.meters import MIN_TIMED_STEPS
from tests.data.nifti.folders import six
from tests.helpers import BAD_INPUTS, compose_config, job_overrides, run_cli, runs, small_run

TIMED = r"~[0-9.e-]+ min ±[0-9]+% \(timed [0-9]+ steps(, machine busy)?\)"  # a timed estimate, as a line ends


def store_files(folder: Path) -> dict[str, str]:
    """The SHA-256 of the store's database and of every file in its artifact folder."""
    paths = [folder / "mlflow.db", *sorted((folder / "mlartifacts").rglob("*"))]
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in paths if path.is_file()}


def listed(stdout: str, fits: bool = False) -> list[str]:
    """The job lines and the total; without ``fits``, each job line's ``| fits ...`` column left out (it depends on the
    memory free: its own test checks it)."""
    lines = [line for line in stdout.splitlines() if line.startswith(("job ", "total: "))]
    return lines if fits else [re.sub(r" \| fits [^|]+(?= \| )", "", line) for line in lines]


def estimates(lines: list[str]) -> list[str]:
    """The estimate of each job line: what follows its last ``| ``."""
    return [line.rsplit(" | ", 1)[1] for line in lines if line.startswith("job ")]


def timings(cache: Path) -> dict[str, dict]:
    return json.loads((cache / step_timing.CACHE.name).read_text())


def job_name(overrides: list[str]) -> str:
    """The run name of a job with ``overrides`` (a long one ends with its config hash)."""
    return run_name(overrides, config_hash(flatten(compose_config(*overrides))))


def job(tmp_path: Path, store: str, shared_data: Path, seed: int) -> tuple[str, float]:
    """A job's run name and predicted peak (MiB), as the dry run of ``small_run`` at ``seed`` and one epoch has them."""
    overrides = job_overrides(tmp_path, store, shared_data, "epochs=1", f"seed={seed}")
    cfg, execution = validate(compose_config(*overrides))
    return job_name(overrides), predict(cfg, execution).total_mb


@pytest.mark.slow
def test_a_dry_sweep_lists_two_runs_and_two_skips_and_leaves_the_store_as_it_was(tmp_path, store, shared_data):
    finished = run_cli("-m", *small_run(tmp_path / "done", store, shared_data, "epochs=1", "seed=0,1"))
    assert finished.returncode == 0, finished.stderr[-3000:]
    done = {r.data.params["seed"]: r for r in runs(store) if r.data.tags.get("mlflow.parentRunId")}
    assert sorted(done) == ["0", "1"] and {r.info.status for r in done.values()} == {"FINISHED"}
    client = mlflow.MlflowClient(store)
    for run in done.values():  # as if they had trained long enough on a quiet machine: a basis for the estimate
        logged = client.get_metric_history(run.info.run_id, "perf/steps_timed")[-1]
        client.log_metric(run.info.run_id, "perf/steps_timed", MIN_TIMED_STEPS, step=logged.step)  # the latest value
        client.set_tag(run.info.run_id, "perf.contended", "false")
    before = store_files(tmp_path)

    def dry_sweep() -> list[str]:
        sweep = ("epochs=1", "seed=0,1,2,3", "dry_run=true")
        result = run_cli("-m", *small_run(tmp_path / "dry", store, shared_data, *sweep))
        assert result.returncode == 0, result.stderr[-3000:]
        return listed(result.stdout)

    lines = dry_sweep()
    assert store_files(tmp_path) == before  # no run, no sweep parent run, no tag, no artifact
    cfg = validate(compose_config(*job_overrides(tmp_path, store, shared_data, "epochs=1")))[0]
    rates = [r.data.metrics["perf/samples_per_s_median"] for r in done.values()]  # same speed: only the seed differs
    minutes = job_seconds(cfg, 1, statistics.median(rates)) / 60
    low, high = (rounded(job_seconds(cfg, 1, rate) / 60) for rate in (max(rates), min(rates)))
    expected = []
    for seed in range(4):
        name, peak = job(tmp_path, store, shared_data, seed)
        action, estimate = (
            (f"skip: finished run {done[str(seed)].info.run_id}", "0 min")
            if str(seed) in done
            else ("run", f"~{rounded(minutes)} min (from 2 finished runs, {low}-{high})")
        )
        expected.append(f"job {seed}: {name} | {action} | peak {peak:.0f} MiB at batch 4 | {estimate}")
    expected.append(f"total: 2 to run, 2 to skip | ~{rounded(2 * minutes)} min | largest peak {peak:.0f} MiB")
    assert lines == expected

    client.set_tag(done["1"].info.run_id, "perf.contended", "true")  # a contended run is no basis
    minutes = job_seconds(cfg, 1, done["0"].data.metrics["perf/samples_per_s_median"]) / 60
    assert estimates(dry_sweep())[2:] == [f"~{rounded(minutes)} min (from 1 finished run)"] * 2


@pytest.mark.slow
def test_a_parallel_dry_sweep_on_a_store_not_created_yet_times_the_jobs_and_creates_nothing(
    tmp_path, new_store, shared_data, monkeypatch
):
    """Two worker processes, one shape: one of them times it, the other waits and reads it."""
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(tmp_path / "cache"))
    result = run_cli(
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        *small_run(tmp_path, new_store, shared_data, "epochs=1", "seed=0,1", "dry_run=true"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlartifacts").exists()
    *jobs, last = listed(result.stdout)  # the jobs' lines come from two worker processes, in any order
    assert len(jobs) == 2 and len(set(estimates(jobs))) == 1 and len(timings(tmp_path / "cache")) == 1
    for seed, line in enumerate(sorted(jobs)):
        name, peak = job(tmp_path, new_store, shared_data, seed)
        prefix = f"job {seed}: {name} | run | peak {peak:.0f} MiB at batch 4 | "
        assert line.startswith(prefix) and re.fullmatch(TIMED, line[len(prefix) :])
    together = rf"2 at once: ~[0-9.e-]+ min, peaks up to {2 * peak:.0f} MiB together"
    assert re.fullmatch(
        rf"total: 2 to run, 0 to skip \| ~[0-9.e-]+ min \| largest peak {peak:.0f} MiB \| {together}", last
    )


@pytest.mark.slow
def test_a_single_dry_run_of_batch_size_auto_lists_the_predicted_batch_unprobed_and_its_total(
    tmp_path, new_store, shared_data
):
    """With a warm-up schedule too: the timed steps are one epoch, which a warm-up must not refuse."""
    auto = ("epochs=2", "warmup_epochs=1", "batch_size=auto", "effective_batch_size=8")
    cfg, execution = validate(compose_config(*job_overrides(tmp_path, new_store, shared_data, *auto)))
    peak = predict(dataclasses.replace(cfg, batch_size=4, accumulate=2), execution).total_mb  # batch 4 trains 4 x 2
    budget = peak / (1 - CPU_HEADROOM) + 1  # room for 4 per step, not 8 (tests/perf/test_autobatch.py's)
    overrides = job_overrides(tmp_path, new_store, shared_data, *auto, f"mem_budget_mb={budget}")
    result = run_cli(*small_run(tmp_path, new_store, shared_data, *auto, f"mem_budget_mb={budget}", "dry_run=true"))
    assert result.returncode == 0, result.stderr[-3000:]
    line, last = listed(result.stdout)
    prefix = f"job 0: {job_name(overrides)} | run | peak {peak:.0f} MiB at batch 4 | "
    assert line.startswith(prefix) and re.fullmatch(TIMED, line[len(prefix) :])
    assert re.fullmatch(rf"total: 1 to run, 0 to skip \| ~[0-9.e-]+ min \| largest peak {peak:.0f} MiB", last)
    assert "batch_size=auto: batch_size=" not in result.stdout + result.stderr  # fit_batch's line after its probe
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_bad_input_and_an_optuna_sweep_fail_a_dry_run_in_one_line_before_anything(tmp_path, new_store, shared_data):
    checked_by_the_dry_run = ("data.root=/nonexistent", "batch_size=2000")  # the others are refused by plan_job
    for overrides, message in [case for case in BAD_INPUTS if case[0][0] in checked_by_the_dry_run]:
        result = run_cli(*small_run(tmp_path, new_store, shared_data, "dry_run=true", *overrides))
        assert result.returncode == 2, (overrides, result.stderr[-2000:])
        assert result.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), (overrides, result.stderr)
        assert listed(result.stdout) == []
    optuna = run_cli("-m", "preset=optuna", *small_run(tmp_path, new_store, shared_data, "dry_run=true"))
    assert optuna.returncode == 2, optuna.stderr[-2000:]
    assert optuna.stderr.strip().splitlines() == [
        "error: dry_run=true lists the jobs of a grid sweep, known before any runs; hydra_plugins.hydra_optuna_sweeper."
        "optuna_sweeper.OptunaSweeper picks each trial from the results of those before it: drop dry_run (finished "
        "trials are skipped)"
    ]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "sweep").exists()


def test_a_jobs_time_is_its_trained_samples_and_a_third_of_its_evaluated_ones_at_the_training_rate(
    tmp_path, store, shared_data
):
    def seconds(*overrides: str, world: int = 1, resume: Resume | None = None) -> float:
        cfg = validate(compose_config(*job_overrides(tmp_path, store, shared_data, *overrides)))[0]
        return job_seconds(cfg, world, 10.0, resume)

    # AdrenalMNIST3D: 1188 train, 98 val, 298 test; batch 4, 2 epochs of 3 batches: 24 trained, 2 x 12 + 12 evaluated
    assert seconds() == pytest.approx((24 + 36 / 3) / 10)
    assert seconds("limit_batches=null", "epochs=1") == pytest.approx((297 * 4 + (98 + 298) / 3) / 10)
    # resumed at epoch 1, step 1: 2 steps of 4 left, one validation and the test
    resume = Resume("id", tmp_path, epoch=1, step=1, batch_size=4, accumulate=1, world=1)
    assert seconds(resume=resume) == pytest.approx((8 + 24 / 3) / 10)
    # DDP, 2 ranks: 594 samples and 148 batches of 4 per rank; rank 0 evaluates alone, at half the summed rate
    ddp = seconds("limit_batches=null", "epochs=1", "parallel=ddp", "parallel.nproc=2", world=2)
    assert ddp == pytest.approx(148 * 4 * 2 / 10 + (98 + 298) / 3 / 5)


@pytest.mark.slow
def test_one_shape_is_timed_once_and_a_second_dry_run_reuses_it_until_it_expires(
    tmp_path, store, shared_data, monkeypatch
):
    """Seeds and learning rates do not change the time per sample: six jobs, one timing, one figure; a second process
    reads the same figure; an entry past its age is timed again."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(cache))

    def dry_sweep() -> list[str]:
        sweep = ("seed=0,1,2", "optim.lr=0.001,0.01", "dry_run=true")
        result = run_cli("-m", *small_run(tmp_path, store, shared_data, *sweep))
        assert result.returncode == 0, result.stderr[-3000:]
        return listed(result.stdout)

    first = dry_sweep()
    assert len(first) == 7 and len(set(estimates(first))) == 1 and re.fullmatch(TIMED, estimates(first)[0])
    (name, entry), *others = timings(cache).items()
    assert not others and entry["steps"] >= step_timing.MIN_STEPS
    assert dry_sweep() == first and timings(cache) == {name: entry}  # read, not timed again

    stale = (now() - step_timing.MAX_AGE - datetime.timedelta(hours=1)).isoformat()
    (cache / step_timing.CACHE.name).write_text(json.dumps({name: {**entry, "at": stale}}))
    dry_sweep()
    assert timings(cache)[name]["at"] > entry["at"]  # timed again, stamped now


@pytest.mark.slow
def test_a_many_job_dry_sweep_plans_each_job_shape_once_and_launches_no_job(tmp_path, store, shared_data, monkeypatch):
    """Twelve jobs of two shapes (the micro-batch sets them apart; seeds and learning rates do not): each shape's
    batch, peak and rate planned once, in the sweep's main process, whose checks composed and planned every job
    already. Each job was composed three times and planned twice, its shape probed each time (a 200-job seed sweep
    took 401 s under load)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MEDSWEEP_CACHE_DIR", str(cache))
    sweep = ("seed=0,1,2", "optim.lr=0.001,0.01", "batch_size=2,4", "epochs=1", "dry_run=true")
    result = run_cli("-m", *small_run(tmp_path, store, shared_data, *sweep))
    assert result.returncode == 0, result.stderr[-3000:]
    *lines, last = listed(result.stdout)
    assert [line.partition(":")[0] for line in lines] == [f"job {n}" for n in range(12)]
    assert last.startswith("total: 12 to run, 0 to skip |")
    logged = result.stdout + result.stderr  # the sweep's main process logs as Hydra's own lines do
    planned = re.findall(r"planned job shape (\d+) \(batch_size=(\d+)\b.*\): jobs ([0-9, -]+)$", logged, re.M)
    assert sorted((shape, batch) for shape, batch, _ in planned) == [("1", "2"), ("2", "4")], logged[-3000:]
    for _, batch, jobs in planned:  # the jobs it planned for: those of its micro-batch
        spans = [part.split("-") for part in jobs.split(", ")]
        numbers = [str(n) for span in spans for n in range(int(span[0]), int(span[-1]) + 1)]
        assert numbers == [line.partition(":")[0][4:] for line in lines if f"at batch {batch} |" in line]
    for batch in ("2", "4"):  # the jobs of a shape list its figures
        assert len({line.split(" | ", 2)[2] for line in lines if f"at batch {batch} |" in line}) == 1
    assert len(timings(cache)) == 2  # one timing per shape, as before
    assert len(json.loads((cache / "memory_predictions.json").read_text())) == 2  # one prediction per shape
    assert not (tmp_path / "sweep").exists()  # no job launched: no job folder, no .hydra/, no figures to gather


def test_a_shapes_jobs_are_named_in_spans():
    assert [spans(n) for n in ([0], [0, 1], [0, 2, 4], list(range(200)), [0, 2, 3, 4, 9])] == [
        "0",
        "0, 1",
        "0, 2, 4",
        "0-199",
        "0, 2-4, 9",
    ]


def test_a_lines_estimate_says_its_basis_and_its_spread():
    assert Rate(10.0, "timed 14 steps", spread=0.083).estimate(12.0) == "~12 min ±8% (timed 14 steps)"
    runs = Rate(10.0, "from 3 finished runs", runs=(9.0, 10.0, 11.0))
    assert runs.estimate(12.0) == "~12 min (from 3 finished runs, 11-13)"  # 12 min at 11/s and at 9/s
    assert Rate(10.0, "from 1 finished run", runs=(10.0,)).estimate(0.5) == "~0.5 min (from 1 finished run)"


@pytest.mark.slow
def test_a_dry_run_and_the_memory_command_take_a_nifti_folder_and_write_no_cache(tmp_path, store, monkeypatch):
    data = six(tmp_path / "scans")
    monkeypatch.delenv("MEDSWEEP_CACHE_DIR")  # the cache would go beside the data: the dry run writes none
    common = ("data=nifti", f"data.root={data}", "data.size=16", "model=resnet10", "batch_size=2", "device=cpu")
    dry = run_cli(*common, "dry_run=true", f"mlflow.tracking_uri={store}", f"hydra.run.dir={tmp_path}/run", timeout=600)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert dry.stdout.strip().splitlines()[-1].startswith("total: 1 to run")
    memory = run_cli(*common, module="src.memory", timeout=600)
    assert memory.returncode == 0, memory.stderr[-3000:]
    assert "predicted peak memory on cpu, batch 2" in memory.stdout
    assert not (data / ".medsweep").exists() and runs(store) == []


@pytest.mark.slow
def test_a_dry_run_lists_whether_each_job_fits_the_budget_and_at_which_batch_and_refuses_none(
    tmp_path, new_store, shared_data
):
    """Under a ``mem_budget_mb`` that batch 2 fits and batch 16 does not, batch 16's line names the largest micro-batch
    predicted to fit; under 1 MiB a given batch and ``batch_size=auto`` fit none: listed, not refused (the real
    jobs would be refused before any run)."""

    def peak(batch: int) -> float:
        cfg, execution = validate(
            compose_config(*job_overrides(tmp_path, new_store, shared_data, f"batch_size={batch}"))
        )
        return predict(cfg, execution).total_mb

    budget = (peak(2) + peak(16)) / 2 / (1 - CPU_HEADROOM)  # batch 2 within its usable part, 16 past it
    overrides = job_overrides(tmp_path, new_store, shared_data, "batch_size=16", f"mem_budget_mb={budget}")
    cfg, execution = validate(compose_config(*overrides))
    largest = largest_predicted(cfg, execution, budget * (1 - CPU_HEADROOM), 15)
    assert 2 <= largest < 16
    sweep = ("batch_size=2,16", f"mem_budget_mb={budget}", "dry_run=true")
    result = run_cli("-m", *small_run(tmp_path, new_store, shared_data, *sweep))
    assert result.returncode == 0, result.stderr[-3000:]
    size = f"{budget:.3g} MiB" if budget < 1024 else f"{budget / 1024:.3g} GiB"
    two, sixteen, _ = listed(result.stdout, fits=True)
    assert f"at batch 2 | fits {size}: yes | ~" in two
    assert f"at batch 16 | fits {size}: no: fits at batch {largest} | ~" in sixteen
    tiny = small_run(tmp_path / "tiny", new_store, shared_data, "batch_size=4,auto", "mem_budget_mb=1", "dry_run=true")
    result = run_cli("-m", *tiny)
    assert result.returncode == 0, result.stderr[-3000:]
    given, auto, _ = listed(result.stdout, fits=True)
    assert (
        "at batch 4 | fits 1 MiB: no batch fits | ~" in given and "at batch 2 | fits 1 MiB: no batch fits | ~" in auto
    )
    assert not (tmp_path / "mlflow.db").exists()
