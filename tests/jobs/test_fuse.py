"""src/jobs/fuse.py: which jobs of a sweep form a fused group (params equal but for the fusable keys, one device,
threads and position), why another trains alone, and a member's config as the group's record gives it back: planned
from it, it is the job's own config (same config hash, params, folder)."""

from __future__ import annotations

import copy

import pytest
from hydra import compose, initialize_config_dir
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from src.errors import UsageError
from src.jobs import fuse
from src.jobs.plan import plan_job
from src.jobs.sweep_checks import SweepJob
from tests.helpers import ROOT, compose_config, hydra_job


def command(tmp_path, store, shared_data, *overrides: str) -> list[str]:
    return [
        "device=cpu",
        "fuse=true",
        "data=adrenalmnist3d",
        f"data.root={shared_data}",
        "data.download=false",
        "model=resnet10",
        f"mlflow.tracking_uri={store}",
        *overrides,
    ]


def planned(tmp_path, store, shared_data, num: int, *overrides: str):
    overrides = command(tmp_path, store, shared_data, *overrides)
    return plan_job(compose_config(*overrides), hydra_job(tmp_path / str(num), overrides))


def test_jobs_that_differ_only_in_fusable_keys_group_and_the_others_say_why(tmp_path, store, shared_data):
    plans = {
        0: planned(tmp_path, store, shared_data, 0, "seed=0"),
        1: planned(tmp_path, store, shared_data, 1, "seed=1", "optim=adamw", "optim.lr=0.01", "aug=standard"),
        2: planned(tmp_path, store, shared_data, 2, "seed=2", "model=resnet18"),
        3: planned(tmp_path, store, shared_data, 3, "seed=3", "label_smoothing=0.1", "ema_decay=0.9"),
        4: planned(tmp_path, store, shared_data, 4, "seed=4", "fuse=false"),
        5: planned(tmp_path, store, shared_data, 5, "seed=5", "batch_size=8"),
    }
    groups, alone = fuse.groups(plans)
    assert groups == [[0, 1, 3]]
    assert alone[2].startswith(fuse.NO_PARTNER) and "differs in model.name" in alone[2]
    assert "differs in batch_size" in alone[5]
    assert 4 not in alone  # fuse=false: its execution says why
    assert fuse.differing(plans[0], plans[1]) == []


def test_a_member_planned_from_the_record_is_the_jobs_own_config(tmp_path, store, shared_data):
    overrides = command(tmp_path, store, shared_data, "seed=3", "optim.lr=0.01", "aug=standard")
    composed = compose_config(*overrides)
    own = plan_job(composed, hydra_job(tmp_path / "3", overrides))
    member = fuse.Member(
        num=3,
        task=OmegaConf.to_container(composed, resolve=True, enum_to_str=True),
        output_dir=str(tmp_path / "3"),
        overrides=overrides,
        job_name="train",
    )
    again = plan_job(*member.configs())
    assert again.config_hash == own.config_hash and again.params == own.params and again.cfg == own.cfg
    assert again.job_dir == own.job_dir and again.run_name == own.run_name and again.multirun
    assert again.job_num == 3


def test_a_single_run_that_may_fuse_says_why_it_trains_alone(tmp_path, store, shared_data):
    plan = planned(tmp_path, store, shared_data, 0, "seed=0")
    assert plan.execution.fuse
    alone = fuse.alone(plan, hydra_job(tmp_path / "0", []))
    assert alone.execution.tags()["fuse.alone_because"] == fuse.SINGLE_RUN and not alone.execution.fuse
    apart = planned(tmp_path, store, shared_data, 1, "seed=0", "fuse=false")
    assert fuse.alone(apart, hydra_job(tmp_path / "1", [])) is apart  # its execution says why: fuse=false


@pytest.mark.parametrize("text", ["{", "[]", '{"groups": 3, "alone": {}}', "\udcff"])
def test_a_damaged_record_is_one_line_naming_it(tmp_path, text):
    (tmp_path / fuse.RECORD).write_text(text, errors="surrogateescape")
    with pytest.raises(UsageError, match=f"^{tmp_path / fuse.RECORD} is not a fuse record .*start the sweep again$"):
        fuse.read_record(tmp_path)
    assert fuse.read_record(tmp_path / "none") is None


def test_a_damaged_done_record_is_one_line_naming_it(tmp_path):
    group = fuse.Group("g0", (), tmp_path)
    group.folder.mkdir(parents=True)
    fuse.mark_done(group, 2, "abc")
    fuse.mark_done(group, 0, "def")
    assert fuse.done(group) == {2: "abc", 0: "def"}
    (group.folder / fuse.DONE).write_text("[1]")
    with pytest.raises(UsageError, match="done.json is damaged .*delete it and run the sweep again$"):
        fuse.done(group)


def test_the_record_gives_each_job_its_group_and_a_sweep_given_the_folder_again_forgets_it(
    tmp_path, store, shared_data
):
    jobs, plans = [], {}
    for num, seed in enumerate((0, 1)):
        overrides = command(tmp_path, store, shared_data, f"seed={seed}")
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            composed = compose("config", overrides=overrides, return_hydra_config=True)
        with open_dict(composed):
            composed.hydra.runtime.output_dir = str(tmp_path / "sweep" / str(num))
            composed.hydra.job.num = num
            composed.hydra.sweep.dir = str(tmp_path / "sweep")
            composed.hydra.mode = RunMode.MULTIRUN
        task = copy.deepcopy(composed)
        with open_dict(task):
            del task["hydra"]
        jobs.append(SweepJob(num, f"seed={seed}", overrides, task, composed.hydra))
        plans[num] = plan_job(task, composed.hydra)
    fuse.write_record(tmp_path / "sweep", jobs, plans)
    group = fuse.group_of(jobs[1].hydra)
    assert group.name == "g0" and [member.num for member in group.members] == [0, 1]
    assert plan_job(*group.members[1].configs()).config_hash == plans[1].config_hash
    group.folder.mkdir(parents=True)
    fuse.mark_done(group, 0, "abc")
    fuse.forget(tmp_path / "sweep")
    assert fuse.group_of(jobs[1].hydra) is None and not (group.folder / fuse.DONE).exists()
