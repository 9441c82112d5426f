"""Real Hydra composition of every config option, and rejection of bad keys, types and values."""

from __future__ import annotations

import dataclasses
import re
from enum import Enum

import mlflow
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf

from src import config as schema
from src.cli import composition_error
from src.errors import UsageError
from src.schema_check import check_known_keys
from src.tracking.identity import flatten
from tests.helpers import ROOT, compose_config, run_cli, small_run

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


MODEL_KEYS = (
    "keys of model: name, stem, dsconv, dsconv_mid_norm, activation, norm, init, init_mode, zero_init_residual, "
    "shortcut, checkpointing, inplace_act: fix the spelling"
)
TOP_LEVEL_KEYS = "top-level keys: " + ", ".join(field.name for field in dataclasses.fields(schema.Config))
MODELS = (
    "densenet121, densenet169, densenet201, densenet264, "
    "resnet10, resnet101, resnet152, resnet18, resnet200, resnet34, resnet50"
)


@pytest.mark.parametrize(
    "override,error,line",
    [
        (
            "amp=maybe",
            ConfigCompositionException,
            "Error merging override amp=maybe; Value 'maybe' is not a valid bool (type str)",
        ),
        (
            "model.activation=tanh",
            ConfigCompositionException,
            "Error merging override model.activation=tanh; "
            "Invalid value 'tanh', expected one of [relu, swish, prelu, gelu, mish]",
        ),
        (
            "model.colour=red",
            ConfigCompositionException,
            f"unknown key model.colour (set by model.colour=red): ModelConfig has no such key; {MODEL_KEYS}",
        ),
        ("model=resnet7", MissingConfigException, f"model=resnet7 is not an option of model: use one of {MODELS}"),
        (
            "data=mnist",
            MissingConfigException,
            "data=mnist is not an option of data: use one of adrenalmnist3d, fracturemnist3d, nodulemnist3d, "
            "organmnist3d, synapsemnist3d, synthetic, vesselmnist3d",
        ),
        (
            "model=resnet7,",
            OverrideParseException,
            "cannot parse the override model=resnet7,; mismatched input '<EOF>' expecting {':', BRACKET_OPEN, "
            "BRACE_OPEN, FLOAT, INT, BOOL, NULL, UNQUOTED_CHAR, ID, ESC, WS, QUOTED_VALUE, INTERPOLATION}; "
            "See https://hydra.cc/docs/1.2/advanced/override_grammar/basic for details",
        ),
    ],
)
def test_bad_keys_types_and_choices_fail_at_composition_in_one_line(override, error, line):
    """Hydra's multi-line composition error becomes the one line that ``python -m src.<command>`` prints."""
    with pytest.raises(error) as raised:
        compose_config(override)
    assert raised.type is error
    assert composition_error(raised.value, [override]) == line


@pytest.mark.parametrize(
    "override,line",
    [
        (
            "+model.colour=red",
            f"unknown key model.colour (forced with +model.colour=red): ModelConfig has no such key; {MODEL_KEYS}",
        ),
        (
            "++model.colour=red",
            f"unknown key model.colour (forced with ++model.colour=red): ModelConfig has no such key; {MODEL_KEYS}",
        ),
        (
            "+model.sub.x=1",
            f"unknown key model.sub (forced with +model.sub.x=1): ModelConfig has no such key; {MODEL_KEYS}",
        ),
        (
            "+model.stm=small",
            "unknown key model.stm (forced with +model.stm=small): ModelConfig has no such key; "
            "did you mean model.stem?",
        ),
        (
            "+mlflow.experimnt=x",
            "unknown key mlflow.experimnt (forced with +mlflow.experimnt=x): MlflowConfig has no such key; "
            "did you mean mlflow.experiment?",
        ),
        (
            "+colour=red",
            f"unknown key colour (forced with +colour=red): Config has no such key; {TOP_LEVEL_KEYS}: fix the spelling",
        ),
    ],
)
def test_keys_forced_with_plus_are_refused_at_any_depth(override, line):
    cfg = compose_config(override)  # Hydra composes them: the schema check refuses them
    with pytest.raises(UsageError, match=f"^{re.escape(line)}$"):
        check_known_keys(cfg, [override])


def test_report_refuses_a_forced_key():
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("report", overrides=["+bar=1", "sweep=x"])
    line = (
        "unknown key bar (forced with +bar=1): ReportConfig has no such key; "
        "top-level keys: mlflow, sweep, parent, out, margin, tags, register: fix the spelling"
    )
    with pytest.raises(UsageError, match=f"^{re.escape(line)}$"):
        check_known_keys(cfg, ["+bar=1", "sweep=x"])


@pytest.mark.parametrize(
    "overrides",
    [(), ("++model.stem=small",), ("experiment=accuracy_cpu",), ("experiment=accuracy_cpu_64",), ("preset=seeds",)],
)
def test_schema_keys_experiments_and_presets_pass_the_check(overrides):
    check_known_keys(compose_config(*overrides), overrides)


def test_the_64_recipe_is_accuracy_cpu_with_a_smaller_model_and_fewer_epochs_at_64():
    cpu, cpu_64 = (flatten(compose_config(f"experiment={name}")) for name in ("accuracy_cpu", "accuracy_cpu_64"))
    assert {key: (cpu[key], cpu_64[key]) for key in cpu if cpu[key] != cpu_64[key]} == {
        "model.name": ("resnet18", "resnet10"),
        "data.size": ("28", "64"),
        "epochs": ("18", "5"),
        "batch_size": ("32", "16"),
        "warmup_epochs": ("2", "1"),
    }


def test_a_swept_forced_key_is_refused_before_the_sweep_starts():
    """The sweep's config holds no swept value: the callback follows a swept ``+key``'s path through the schema."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra.mode=MULTIRUN"], return_hydra_config=True)
        for fine in (
            "++model.stem=small,standard",
            "model.dsconv=true,false",
            "+experiment=a,b",
            "+hydra/launcher=a,b",
        ):
            check_known_keys(cfg, [fine])
        line = (
            f"unknown key model.colour (forced with +model.colour=red,blue): ModelConfig has no such key; {MODEL_KEYS}"
        )
        with pytest.raises(UsageError, match=f"^{re.escape(line)}$"):
            check_known_keys(cfg, ["+model.colour=red,blue"])


@pytest.mark.parametrize(
    "module,args,line",
    [
        (
            "src.train",
            ("+model.colour=red",),
            f"unknown key model.colour (forced with +model.colour=red): ModelConfig has no such key; {MODEL_KEYS}",
        ),
        (
            "src.train",
            ("-m", "+model.colour=red"),
            f"unknown key model.colour (forced with +model.colour=red): ModelConfig has no such key; {MODEL_KEYS}",
        ),
        (
            "src.memory",
            ("+model.colour=red",),
            f"unknown key model.colour (forced with +model.colour=red): ModelConfig has no such key; {MODEL_KEYS}",
        ),
        (
            "src.summary",
            ("+foo=1",),
            f"unknown key foo (forced with +foo=1): Config has no such key; {TOP_LEVEL_KEYS}: fix the spelling",
        ),
        (
            "src.report",
            ("+bar=1", "sweep=x"),
            "unknown key bar (forced with +bar=1): ReportConfig has no such key; "
            "top-level keys: mlflow, sweep, parent, out, margin, tags, register: fix the spelling",
        ),
    ],
    ids=["train", "train-multirun", "memory", "summary", "report"],
)
def test_a_forced_unknown_key_stops_each_command_in_one_line_and_creates_no_run(
    tmp_path, store, shared_data, module, args, line
):
    extra = small_run(tmp_path, store, shared_data) if module == "src.train" else (f"mlflow.tracking_uri={store}",)
    result = run_cli(*args, *extra, module=module)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [f"error: {line}"]
    client = mlflow.MlflowClient(store)
    assert client.search_runs([experiment.experiment_id for experiment in client.search_experiments()]) == []


@pytest.mark.parametrize(
    "override,message",
    [
        ("batch_size=0", "batch_size=0 must be >= 1"),
        ("batch_size=four", "batch_size=four must be an integer >= 1, auto or derived"),
        ("effective_batch_size=0", "effective_batch_size=0 must be >= 1 or null"),
        ("accumulate=0", "accumulate=0 must be >= 1"),
        ("data.size=32", "data.size=32 is not a MedMNIST 3D size: use data.size=28 or 64"),
        ("limit_batches=0", "limit_batches=0 must be >= 1 or null"),
        ("tags=[status]", "tags: status is a tag medsweep sets itself: choose another name"),
        ("tags=[a.b]", "tags: 'a.b' is not a tag name: use letters, digits, _ and - (tags=[baseline,amp])"),
        ("mlflow.system_metrics_interval_s=0", "mlflow.system_metrics_interval_s=0.0 must be > 0"),
        ("ema_decay=1", "ema_decay=1.0 must be in (0, 1) or null (no EMA)"),
    ],
)
def test_cross_field_checks_name_the_value(override, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        OmegaConf.to_object(compose_config(override))
