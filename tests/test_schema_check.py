"""Keys the schema does not declare and values outside its ranges, refused in one line by every command
(``src/schema_check.py``, ``src/cli.py``); Hydra's composition errors as one line."""

from __future__ import annotations

import dataclasses
import re

import mlflow
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

from src.config import Config
from src.errors import UsageError
from src.models import MODELS
from src.schema_check import check_known_keys, check_values, composition_error
from tests.helpers import ROOT, compose_config, compose_report, run_cli, small_run

MODEL_KEYS = (
    "keys of model: name, stem, dsconv, dsconv_mid_norm, activation, norm, init, init_mode, zero_init_residual, "
    "shortcut, checkpointing, inplace_act: fix the spelling"
)
TOP_LEVEL_KEYS = "top-level keys: " + ", ".join(field.name for field in dataclasses.fields(Config))
ZOO = ", ".join(sorted(MODELS))  # the model group's options, as Hydra lists them


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
        ("model=resnet7", MissingConfigException, f"model=resnet7 is not an option of model: use one of {ZOO}"),
        (
            "data=mnist",
            MissingConfigException,
            "data=mnist is not an option of data: use one of adrenalmnist3d, fracturemnist3d, nifti, nodulemnist3d, "
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


@pytest.mark.parametrize("override,key", [("~seed", "seed"), ("~seed=0", "seed"), ("~mlflow", "mlflow")])
def test_a_schema_key_deleted_with_tilde_is_refused(override, key):
    """The job ran on the key's default, logged without it: under another config hash than the default's (``~seed``),
    or to the default store (``~mlflow``, after ``mlflow.tracking_uri=...``)."""
    cfg = compose_config(override)  # Hydra composes it: the schema check refuses it
    line = (
        f"{override}: a key of the schema cannot be deleted (the job would run on its default, logged without it): "
        f"set {key} to the value wanted, or drop {override}"
    )
    with pytest.raises(UsageError, match=f"^{re.escape(line)}$"):
        check_known_keys(cfg, [override])


def test_report_refuses_a_forced_key():
    cfg = compose_report("+bar=1", "sweep=x")
    line = (
        "unknown key bar (forced with +bar=1): ReportConfig has no such key; "
        "top-level keys: mlflow, sweep, parent, out, margin, speed_margin, memory_margin, tags, register: "
        "fix the spelling"
    )
    with pytest.raises(UsageError, match=f"^{re.escape(line)}$"):
        check_known_keys(cfg, ["+bar=1", "sweep=x"])


@pytest.mark.parametrize(
    "overrides",
    [(), ("++model.stem=small",), ("aug=standard",)]
    + [
        (f"{group}={path.stem}",)
        for group in ("experiment", "preset")
        for path in sorted((ROOT / "conf" / group).glob("*.yaml"))
    ],
)
def test_schema_keys_experiments_and_presets_pass_the_check(overrides):
    cfg = compose_config(*overrides)
    check_known_keys(cfg, overrides)
    check_values(cfg)


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
            "top-level keys: mlflow, sweep, parent, out, margin, speed_margin, memory_margin, tags, register: "
            "fix the spelling",
        ),
        ("src.report", ("margin=-0.1",), "margin=-0.1 must be in [0, 1] (an AUC difference)"),
        (
            "src.train",
            ("effective_batch_size=32",),  # small_run's batch_size=4: it trained batch 4 under another config hash
            "effective_batch_size=32: batch_size=4 ignores it (only batch_size=auto or derived reads it): drop it, "
            "or set batch_size=derived",
        ),
    ],
    ids=["train", "train-multirun", "memory", "summary", "report", "report-margin", "train-effective-batch"],
)  # more values out of range, each command: tests/test_cli.py (slow)
def test_a_bad_key_or_value_stops_each_command_in_one_line_and_creates_no_run(
    tmp_path, store, shared_data, module, args, line
):
    extra = small_run(tmp_path, store, shared_data) if module == "src.train" else (f"mlflow.tracking_uri={store}",)
    result = run_cli(*args, *extra, module=module)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [f"error: {line}"]
    client = mlflow.MlflowClient(store)
    assert client.search_runs([experiment.experiment_id for experiment in client.search_experiments()]) == []


@pytest.mark.parametrize(
    "override,line",
    [
        ("optim.lr=-0.1", "optim.lr=-0.1 must be >= 0 (0 freezes the weights)"),
        (
            "data.num_classes=???",
            "data.num_classes: Structured config of type `DataConfig` has missing mandatory value: num_classes",
        ),
        (
            "seed=${optim.lr}",
            "seed: While dereferencing interpolation '${optim.lr}': "
            "Value '0.001' of type 'float' could not be converted to Integer",
        ),
    ],
)
def test_commands_check_the_values_as_one_usage_error_line(override, line):
    """The command wrapper's check before any command starts: ranges, missing values, OmegaConf's type errors."""
    with pytest.raises(UsageError, match=f"^{re.escape(line)}$"):
        check_values(compose_config(override))
