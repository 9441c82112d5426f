"""Which jobs of a sweep train fused (``fuse``: docs/fused.md), decided once in the sweep's main process and read by
every job.

Once every job is planned (:mod:`src.jobs.sweep_main`), the jobs that will train and may fuse (their execution's
``fuse``) are grouped: jobs whose params are equal but for :func:`src.training.fused.fusable` keys, on one device with
one thread count, starting at one position (new, or resumed at the same epoch and step) form a group. The groups and
each grouped job's composed config are written to the sweep folder's record (:data:`RECORD`), with why each other
job that may fuse trains alone. A job's call reads its group there (:func:`group_of`); whichever call of a group comes
first holds the group's folder and trains it (:mod:`src.jobs.fused_job`), marking each member done as it ends.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from src.atomic import atomic_path
from src.config import Config
from src.errors import UsageError
from src.jobs.plan import Plan
from src.training.fused import fusable

log = logging.getLogger(__name__)

RECORD = ".fuse.json"  # in the sweep folder: the groups and their members' configs
GROUPS = ".fuse"  # in the sweep folder: a folder per group, held by the process that trains it, with its done record
DONE = "done.json"  # in a group's folder: member job number -> its run, for the members that ended
NO_PARTNER = "no other job of the sweep differs from it only in keys a fused group's members may differ in"
SINGLE_RUN = "a single run: fuse groups the jobs of a sweep (-m)"
NOT_GRID = "its sweeper picks each trial after the ones before it (Optuna): fuse groups the jobs of a grid sweep"


@dataclass(frozen=True)
class Member:
    """One job of a group as its own call would plan it: its number, composed config and Hydra folder and overrides;
    ``hydra``: its Hydra config as composed (unresolved), which its folder's ``.hydra/hydra.yaml`` holds."""

    num: int
    task: dict[str, Any]
    output_dir: str
    overrides: list[str]
    job_name: str
    hydra: dict[str, Any] | None = None

    def configs(self) -> tuple[DictConfig, DictConfig]:
        """The job's composed config (typed by the schema) and the Hydra config :func:`src.jobs.plan.plan_job` reads."""
        task = OmegaConf.merge(OmegaConf.structured(Config), self.task)
        hydra = OmegaConf.create(
            {
                "runtime": {"output_dir": self.output_dir},
                "overrides": {"task": list(self.overrides)},
                "job": {"name": self.job_name, "num": self.num, "id": f"{self.job_name}_{self.num}"},
                "mode": RunMode.MULTIRUN,
            }
        )
        return task, hydra


@dataclass(frozen=True)
class Group:
    """A group of a sweep: its name (its first job's number), members in job order, and the sweep folder."""

    name: str
    members: tuple[Member, ...]
    sweep_dir: Path

    @property
    def folder(self) -> Path:
        return self.sweep_dir / GROUPS / self.name

    def tags(self, trained: int) -> dict[str, str]:
        """A member run's tags: trained fused, in which group (unique to the sweep folder) and with how many."""
        return {"fuse": "true", "fuse.group": f"{self.sweep_dir.resolve()}#{self.name}", "fuse.size": str(trained)}


def group_key(plan: Plan) -> tuple:
    """What the members of a group share: every param but the fusable ones, the device and threads, the position."""
    position = (plan.resume.epoch, plan.resume.step) if plan.resume else (0, 0)
    fixed = tuple(sorted((key, value) for key, value in plan.params.items() if not fusable(key)))
    return fixed, str(plan.execution.device), plan.execution.threads, position


def differing(a: Plan, b: Plan) -> list[str]:
    """The keys that keep ``a`` and ``b`` apart: unfusable params that differ, then device, threads or position."""
    keys = sorted(k for k in a.params.keys() | b.params.keys() if not fusable(k) and a.params.get(k) != b.params.get(k))
    _, *rest_a = group_key(a)
    _, *rest_b = group_key(b)
    what = ("device", "num_threads", "resumed position")
    return keys + [name for name, x, y in zip(what, rest_a, rest_b, strict=True) if x != y]


def groups(plans: dict[int, Plan]) -> tuple[list[list[int]], dict[int, str]]:
    """The groups (job numbers, in order; two or more each) of the jobs ``plans`` holds (those that will train), and
    why each other job that may fuse trains alone."""
    keyed: dict[tuple, list[int]] = {}
    for num, plan in sorted(plans.items()):
        if plan.execution.fuse:
            keyed.setdefault(group_key(plan), []).append(num)
    found = [nums for nums in keyed.values() if len(nums) > 1]
    alone = {}
    for nums in keyed.values():
        if len(nums) == 1:
            (num,) = nums
            others = [other for other in plans if other != num and plans[other].execution.fuse]
            nearest = min(others, key=lambda other: len(differing(plans[num], plans[other])), default=None)
            why = NO_PARTNER
            if nearest is not None:
                why += f" (job {nearest} differs in {', '.join(differing(plans[num], plans[nearest])[:3])})"
            alone[num] = why
    return found, alone


def write_record(sweep_dir: Path, jobs: Sequence[Any], plans: dict[int, Plan]) -> None:
    """The sweep's groups and their members (``jobs``: :class:`src.jobs.sweep_checks.SweepJob`), written to the sweep
    folder's :data:`RECORD` (an earlier command's there replaced, and its groups' done records removed: the sweep
    folder is held), with why each other job that may fuse trains alone; each group logged in one line."""
    found, alone = groups(plans)
    by_num = {job.num: job for job in jobs}
    record = {"groups": {}, "alone": {str(num): why for num, why in alone.items()}}
    for nums in found:
        members = []
        for num in nums:
            job = by_num[num]
            members.append(
                {
                    "num": num,
                    "task": OmegaConf.to_container(job.task, resolve=True, enum_to_str=True),
                    "output_dir": str(job.hydra.runtime.output_dir),
                    "overrides": list(job.overrides),
                    "job_name": str(job.hydra.job.name),
                    "hydra": OmegaConf.to_container(job.hydra, resolve=False, enum_to_str=True),
                }
            )
        record["groups"][f"g{nums[0]}"] = members
        log.info("fused group g%d: jobs %s train as one stacked model", nums[0], ", ".join(map(str, nums)))
    forget(sweep_dir)
    with atomic_path(sweep_dir / RECORD) as path:
        path.write_text(json.dumps(record))


def forget(sweep_dir: Path) -> None:
    """An earlier command's record and done records, in a sweep folder given again (held by this sweep: no other
    command uses them)."""
    for stale in (sweep_dir / GROUPS).glob(f"*/{DONE}"):
        stale.unlink()
    (sweep_dir / RECORD).unlink(missing_ok=True)


def read_record(sweep_dir: Path) -> dict[str, Any] | None:
    """The sweep folder's record; None where it has none (no job may fuse, an Optuna sweep, a dry run)."""
    path = sweep_dir / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if not (isinstance(record.get("groups"), dict) and isinstance(record.get("alone"), dict)):
            raise ValueError("no groups")
    except (OSError, ValueError, AttributeError) as err:
        raise UsageError(
            f"{path} is not a fuse record ({err}): the sweep's main process writes it; start the sweep again"
        ) from None
    return record


def group_of(hydra_cfg: DictConfig) -> Group | None:
    """The group of this Hydra job, from its sweep folder's record; None where it trains alone."""
    if hydra_cfg.mode is not RunMode.MULTIRUN:
        return None
    sweep_dir = Path(hydra_cfg.sweep.dir)
    record = read_record(sweep_dir)
    num = OmegaConf.select(hydra_cfg, "job.num", default=None)
    for name, members in (record or {}).get("groups", {}).items():
        if any(member["num"] == num for member in members):
            return Group(name, tuple(Member(**member) for member in members), sweep_dir)
    return None


def alone(plan: Plan, hydra_cfg: DictConfig) -> Plan:
    """The plan of a job that trains by itself, its execution saying why where it might have fused: its sweep's
    record's reason, or that it is a single run."""
    if not plan.execution.fuse:
        return plan
    why = SINGLE_RUN
    if hydra_cfg.mode is RunMode.MULTIRUN:
        record = read_record(Path(hydra_cfg.sweep.dir))
        why = NOT_GRID if record is None else record["alone"].get(str(plan.job_num), NO_PARTNER)
    return dataclasses.replace(plan, execution=plan.execution.alone(why))


def done(group: Group) -> dict[int, str]:
    """The group's members that ended (job number -> run id), from its folder's :data:`DONE`."""
    path = group.folder / DONE
    if not path.is_file():
        return {}
    try:
        return {int(num): str(run_id) for num, run_id in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError) as err:
        raise UsageError(f"{path} is damaged ({err}): delete it and run the sweep again") from None


def mark_done(group: Group, num: int, run_id: str) -> None:
    """Member ``num`` ended in run ``run_id``: its own call returns that run's result, trains nothing."""
    ended = {**done(group), num: run_id}
    with atomic_path(group.folder / DONE) as path:
        path.write_text(json.dumps({str(k): v for k, v in ended.items()}))
