"""The schema (``src/config/``) as Hydra composes ``conf/`` on it: every group option, enum choice and key."""

from __future__ import annotations

import ast
import sys
from enum import Enum

import pytest
from omegaconf import OmegaConf

from src.config import (
    Activation,
    AmpDtype,
    Device,
    Init,
    InitMode,
    Intensity,
    Loader,
    Norm,
    OptimName,
    ParallelMode,
    SchedName,
    Shortcut,
    Stem,
)
from src.data.shipped import SHIPPED
from src.models import MODELS
from src.tracking.identity import flatten
from tests.config.helpers import held_and_given
from tests.helpers import ROOT, compose_config, run_process

GROUPS = {
    group: sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
    for group in ("data", "optim", "sched", "parallel")
}
GROUPS["model"] = sorted(MODELS)  # the registry stores the model group: no file each


def test_groups_hold_the_documented_options():
    assert GROUPS["data"] == sorted(
        [
            "organmnist3d",
            "nodulemnist3d",
            "adrenalmnist3d",
            "fracturemnist3d",
            "vesselmnist3d",
            "synapsemnist3d",
            "synthetic",
            "nifti",
        ]
    )
    assert GROUPS["optim"] == ["adam", "adamw", "sgd"]
    assert GROUPS["sched"] == ["cosine", "cyclic", "multistep", "none"]
    assert "none" in GROUPS["parallel"]


def test_defaults():
    cfg = OmegaConf.to_object(compose_config())
    assert (cfg.data.name, cfg.model.name, cfg.optim.name, cfg.sched.name, cfg.parallel.mode) == (
        "adrenalmnist3d",
        "densenet121",
        OptimName.adam,
        SchedName.multistep,
        ParallelMode.none,
    )
    assert cfg.data.root == str(SHIPPED) and cfg.data.size == 28 and cfg.data.download
    assert cfg.sched.milestones == [0.5, 0.75] and cfg.sched.gamma == 0.1


@pytest.mark.parametrize(
    "overrides,root",
    [
        ((), str(SHIPPED)),
        (("data.size=64",), str(SHIPPED)),
        (("data=vesselmnist3d",), str(SHIPPED)),
        (("data=vesselmnist3d", "data.size=64"), "~/.medmnist"),
        (("data=organmnist3d",), "~/.medmnist"),
        (("data.root=/d",), "/d"),
    ],
)
def test_a_shipped_file_is_found_without_a_data_root_and_the_others_download(overrides, root):
    assert OmegaConf.to_object(compose_config(*overrides)).data.root == root


@pytest.mark.parametrize("group,option", [(g, o) for g, options in GROUPS.items() for o in options])
def test_every_group_option_composes(group, option):
    cfg = OmegaConf.to_object(compose_config(f"{group}={option}"))
    node = getattr(cfg, group)
    name = node.mode if group == "parallel" else node.name
    assert (name.value if isinstance(name, Enum) else name) == option


def enum_overrides():
    for field, enum in [
        ("model.stem", Stem),
        ("model.activation", Activation),
        ("model.norm", Norm),
        ("model.init", Init),
        ("model.init_mode", InitMode),
        ("model.shortcut", Shortcut),
        ("amp_dtype", AmpDtype),
        ("device", Device),
        ("data.loader", Loader),
        ("data.intensity", Intensity),
    ]:
        for member in enum:
            yield field, member


@pytest.mark.parametrize("key,member", list(enum_overrides()), ids=lambda v: getattr(v, "name", v))
def test_every_enum_choice_composes_by_its_override_name(key, member):
    dataset = ["data=nifti"] if key == "data.intensity" else []  # the one dataset that reads it
    cfg = OmegaConf.to_object(compose_config(*dataset, f"{key}={member.name}"))
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    assert node is member


def test_top_level_keys_are_the_documented_ones():
    cfg = compose_config(
        "amp=true",
        "batch_size=4",
        "accumulate=2",
        "epochs=3",
        "seed=7",
        "deterministic=true",
        "limit_batches=2",
        "num_threads=1",
        "grad_clip=1.0",
        "channels_last=true",
        "cudnn_benchmark=true",
        "data.size=64",
        "data.download=false",
        "data.root=/x",
        "mlflow.tracking_uri=sqlite:///x.db",
        "mlflow.experiment=e",
    )
    typed = OmegaConf.to_object(cfg)
    assert (typed.amp, typed.batch_size, typed.accumulate, typed.limit_batches, typed.grad_clip) == (True, 4, 2, 2, 1.0)
    assert typed.data.size == 64 and typed.mlflow.experiment == "e"


@pytest.mark.parametrize(
    "negative,zero",
    [("optim.weight_decay=-0.0", "optim.weight_decay=0"), ("optim.betas=[-0.0,0.9]", "optim.betas=[0,0.9]")],
)
def test_negative_zero_is_zeros_run(negative, zero):
    """-0.0 == 0: the same params, hence one config hash (skip_finished skips the other's run)."""
    assert flatten(compose_config(negative)) == flatten(compose_config(zero))


def test_the_64_recipe_is_accuracy_cpu_with_a_smaller_model_and_fewer_epochs_at_64():
    cpu, cpu_64 = (flatten(compose_config(f"experiment={name}")) for name in ("accuracy_cpu", "accuracy_cpu_64"))
    assert {key: (cpu[key], cpu_64[key]) for key in cpu if cpu[key] != cpu_64[key]} == {
        "model.name": ("resnet18", "resnet10"),
        "data.size": ("28", "64"),
        "epochs": ("18", "5"),
        "batch_size": ("32", "16"),
        "warmup_epochs": ("2", "1"),
    }


@pytest.mark.parametrize(
    "overrides",
    [
        ["data=synthetic", "data.synthetic_samples=[8,4,4]"],
        ["data=nifti", "data.spacing=[1,1,1]", "data.intensity=window", "data.window_width=300"],
        ["data.split_seed=0", "data.intensity=minmax"],  # the defaults, given
    ],
)
def test_the_data_keys_a_dataset_reads_are_taken(overrides):
    """Each key a dataset reads, set on it, is refused by no check (:func:`src.config.ranges.check_unread`) and held
    as given."""
    typed = OmegaConf.to_object(compose_config(*overrides))
    for override in overrides:
        held, given = held_and_given(typed, override)
        assert held == given, override


def test_the_config_package_imports_no_torch_and_of_medsweep_only_its_errors():
    """It sits below every other package (docs/architecture.md), and a command's config is checked before torch
    loads."""
    for path in sorted((ROOT / "src" / "config").glob("*.py")):
        nodes = list(ast.walk(ast.parse(path.read_text())))
        imported = {node.module for node in nodes if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names}
        outside = {name for name in imported if name and name.split(".")[0] in ("src", "torch")}
        assert {name for name in outside if not name.startswith("src.config")} <= {"src.errors"}, path.name
    code = "import sys, src.config, src.config.reference; print('torch' in sys.modules)"
    assert run_process([sys.executable, "-c", code]).stdout.strip() == "False"
