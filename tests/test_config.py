"""Real Hydra composition of every config option, and rejection of bad keys, types and values."""

from __future__ import annotations

from enum import Enum

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from src import config as schema
from tests.helpers import ROOT, compose_config

GROUPS = {
    group: sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
    for group in ("data", "model", "optim", "sched", "parallel")
}


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
        ]
    )
    assert GROUPS["optim"] == ["adam", "adamw", "sgd"]
    assert GROUPS["sched"] == ["cosine", "cyclic", "multistep", "none"]
    assert "none" in GROUPS["parallel"]


def test_defaults():
    cfg = OmegaConf.to_object(compose_config())
    assert (cfg.data.name, cfg.model.name, cfg.optim.name, cfg.sched.name, cfg.parallel.mode) == (
        "organmnist3d",
        "densenet121",
        schema.OptimName.adam,
        schema.SchedName.multistep,
        schema.ParallelMode.none,
    )
    assert cfg.data.root == "~/.medmnist" and cfg.data.size == 28 and cfg.data.download
    assert cfg.sched.milestones == [0.5, 0.75] and cfg.sched.gamma == 0.1


@pytest.mark.parametrize("group,option", [(g, o) for g, options in GROUPS.items() for o in options])
def test_every_group_option_composes(group, option):
    cfg = OmegaConf.to_object(compose_config(f"{group}={option}"))
    node = getattr(cfg, group)
    name = node.mode if group == "parallel" else node.name
    assert (name.value if isinstance(name, Enum) else name) == option


def enum_overrides():
    for field, enum in [
        ("model.stem", schema.Stem),
        ("model.activation", schema.Activation),
        ("model.norm", schema.Norm),
        ("model.init", schema.Init),
        ("model.init_mode", schema.InitMode),
        ("model.shortcut", schema.Shortcut),
        ("amp_dtype", schema.AmpDtype),
        ("device", schema.Device),
        ("data.loader", schema.Loader),
    ]:
        for member in enum:
            yield field, member


@pytest.mark.parametrize("key,member", list(enum_overrides()), ids=lambda v: getattr(v, "name", v))
def test_every_enum_choice_composes_by_its_override_name(key, member):
    cfg = OmegaConf.to_object(compose_config(f"{key}={member.name}"))
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
    "override,message",
    [
        ("amp=maybe", "amp"),
        ("model.activation=tanh", "tanh"),
        ("model.colour=red", "colour"),
        ("model=resnet7", "resnet7"),
        ("data=mnist", "mnist"),
    ],
)
def test_bad_keys_types_and_choices_fail_at_composition(override, message):
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(override)
    assert message in str(err.value) or message in str(err.value.__cause__)


@pytest.mark.parametrize(
    "override,message",
    [
        ("batch_size=0", "batch_size=0 must be >= 1"),
        ("batch_size=four", "batch_size=four must be an integer >= 1, auto or derived"),
        ("effective_batch_size=0", "effective_batch_size=0 must be >= 1"),
        ("accumulate=0", "accumulate=0 must be >= 1"),
        ("data.size=32", "data.size=32 is not a MedMNIST 3D size"),
        ("limit_batches=0", "limit_batches=0"),
    ],
)
def test_cross_field_checks_name_the_value(override, message):
    with pytest.raises(ValueError, match=message):
        OmegaConf.to_object(compose_config(override))
