"""Each key's range (``src/config/ranges.py``, ``src/config/rules.py``): a value outside it refused naming the key,
the value and the range; the values at its edges taken."""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Iterator

import pytest
from mlflow.exceptions import MlflowException
from omegaconf import OmegaConf

from src.config import (
    EXPERIMENT_NAME_MAX,
    MODEL_NAME_BANNED,
    PARAM_VALUE_MAX,
    TAG_KEY_MAX,
    Config,
    ReportConfig,
)
from tests.config.helpers import held_and_given
from tests.helpers import compose_config, compose_report

CYCLIC_WARMUP = (
    "warmup_epochs=1 with sched=cyclic, which steps per optimizer step: use warmup_epochs=0 or a per-epoch schedule"
)
NOT_A_URL = "must be an http(s):// or file:// URL, or null (medmnist's own)"


BAD_VALUES = [
    ("batch_size=0", "batch_size=0 must be in [1, 2147483647]"),
    ("batch_size=four", "batch_size=four must be an integer >= 1, auto or derived"),
    ("effective_batch_size=0", "effective_batch_size=0 must be in [1, 2147483647] or null"),
    ("accumulate=0", "accumulate=0 must be in [1, 2147483647]"),
    ("epochs=0", "epochs=0 must be in [1, 2147483647]"),
    (f"epochs={10**400}", f"epochs={10**400} must be in [1, 2147483647]"),
    ("batch_size=9223372036854775808", "batch_size=9223372036854775808 must be in [1, 2147483647]"),
    ("data.in_channels=100000", "data.in_channels=100000 must be in [1, 1024]"),
    ("data.num_classes=99999999999999999999", "data.num_classes=99999999999999999999 must be in [2, 100000]"),
    ("log_every=0", "log_every=0 must be in [1, 2147483647]"),
    ("limit_batches=0", "limit_batches=0 must be in [1, 2147483647] or null"),
    ("num_threads=0", "num_threads=0 must be in [1, 1024] or null"),
    ("num_threads=100000", "num_threads=100000 must be in [1, 1024] or null"),  # libgomp: a segfault mid-run
    ("early_stop_patience=0", "early_stop_patience=0 must be in [1, 2147483647] or null"),
    (  # every epoch is the best so far: it trained as without it, under another config hash
        "early_stop_patience=2 select_by=last",
        "early_stop_patience=2 with select_by=last, whose every epoch is the best so far: it never stops the run: "
        "drop it, or select by val_loss, val_auc or val_auc_smoothed",
    ),
    ("mem_budget_mb=0", "mem_budget_mb=0.0 must be > 0 or null"),
    ("seed=-1", "seed=-1 must be in [0, 4294967295]"),
    ("seed=4294967296", "seed=4294967296 must be in [0, 4294967295]"),
    ("label_smoothing=1", "label_smoothing=1.0 must be in [0, 1)"),
    ("warmup_epochs=-1", "warmup_epochs=-1 must be in [0, 15) (below epochs=15)"),
    ("warmup_epochs=3 epochs=3", "warmup_epochs=3 must be in [0, 3) (below epochs=3)"),
    ("ema_decay=1", "ema_decay=1.0 must be in (0, 1) or null (no EMA)"),
    ("grad_clip=0", "grad_clip=0.0 must be > 0 or null"),
    (
        f"mlflow.experiment={'e' * 501}",
        "mlflow.experiment is 501 characters long: at most 500 (MLflow's limit for an experiment name)",
    ),
    (f"tags=[{'t' * 251}]", "tags: a name is 251 characters long: at most 250 (MLflow's limit for a tag key)"),
    ("tags=[status]", "tags: status is a tag medsweep sets itself: choose another name"),
    ("tags=[a.b]", "tags: 'a.b' is not a tag name: use letters, digits, _ and - (tags=[baseline,amp])"),
    ("data.size=32", "data.size=32 is not a MedMNIST 3D size: use data.size=28 or 64"),
    ("data.url=ftp://x/a.npz", f"data.url='ftp://x/a.npz' {NOT_A_URL}"),
    ("data.url=x.org/a.npz", f"data.url='x.org/a.npz' {NOT_A_URL}"),
    ("data.in_channels=0", "data.in_channels=0 must be in [1, 1024]"),
    ("data.num_classes=1", "data.num_classes=1 must be in [2, 100000]"),
    (  # data=synthetic trained it: binary sensitivity and specificity of a 3-output model, FINISHED
        "data=synthetic data.num_classes=3 data.task=binary-class",
        "data.task=binary-class with data.num_classes=3: a binary task has 2 classes: use data.num_classes=2, or "
        "data.task=multi-class",
    ),
    (
        "data.task=multi-label",
        "data.task=multi-label is not a task the trainer supports: use one of binary-class, multi-class",
    ),
    ("data.num_workers=-1", "data.num_workers=-1 must be in [0, 64] (worker processes per rank)"),
    ("data.num_workers=100000", "data.num_workers=100000 must be in [0, 64] (worker processes per rank)"),
    (
        "data.synthetic_samples=[256,64]",
        "data.synthetic_samples=[256, 64] must be 3 values: the train, val and test sizes, e.g. [256,64,64]",
    ),
    ("data.synthetic_samples=[256,0,64]", "data.synthetic_samples[1]=0 must be >= 1"),
    (
        "data.spacing=[1,1,1]",
        "data.spacing=[1.0, 1.0, 1.0]: data=adrenalmnist3d ignores it (only data=nifti reads it): drop it",
    ),
    (
        "data=synthetic data.intensity=zscore",
        "data.intensity=zscore: data=synthetic ignores it (only data=nifti reads it): drop it",
    ),
    (
        "data.synthetic_samples=[8,4,4]",
        "data.synthetic_samples=[8, 4, 4]: data=adrenalmnist3d ignores it (only data=synthetic reads it): drop it",
    ),
    (
        "data=nifti data.window_width=300",
        "data.window_width=300.0: data.intensity=minmax ignores it (only data=nifti with data.intensity=window reads "
        "it): drop it",
    ),
    (
        "data.num_workers=4",
        "data.num_workers=4: data.loader=tensor ignores it (only data.loader=dataloader reads it): drop it",
    ),
    ("optim.momentum=0.5", "optim.momentum=0.5: optim=adam ignores it (only optim=sgd reads it): drop it"),
    (
        "optim=sgd optim.betas=[0.8,0.9]",
        "optim.betas=[0.8, 0.9]: optim=sgd ignores it (only optim=adam or adamw reads it): drop it",
    ),
    (
        "sched=cosine sched.milestones=[0.3]",
        "sched.milestones=[0.3]: sched=cosine ignores it (only sched=multistep reads it): drop it",
    ),
    ("sched=none sched.min_lr=0.1", "sched.min_lr=0.1: sched=none ignores it (only sched=cosine reads it): drop it"),
    ("sched.base_lr=0.01", "sched.base_lr=0.01: sched=multistep ignores it (only sched=cyclic reads it): drop it"),
    ("aug.affine_p=1.5", "aug.affine_p=1.5 must be in [0, 1] (a probability)"),
    ("aug.affine_degrees=181", "aug.affine_degrees=181.0 must be in [0, 180] (rotation in +- affine_degrees)"),
    ("aug.affine_degrees=-1", "aug.affine_degrees=-1.0 must be in [0, 180] (rotation in +- affine_degrees)"),
    ("aug.affine_scale=1", "aug.affine_scale=1.0 must be in [0, 1) (scale 1 +- affine_scale)"),
    ("aug.affine_translate=1.5", "aug.affine_translate=1.5 must be in [0, 1] (shift in +- affine_translate sides)"),
    ("aug.intensity_scale=1", "aug.intensity_scale=1.0 must be in [0, 1) (contrast 1 +- intensity_scale)"),
    ("aug.intensity_shift=-0.1", "aug.intensity_shift=-0.1 must be in [0, 1] (brightness on the [-1, 1] scale)"),
    ("aug.noise_std=-0.1", "aug.noise_std=-0.1 must be in [0, 1] (on the [-1, 1] scale)"),
    ("aug.noise_std=1e308", "aug.noise_std=1e+308 must be in [0, 1] (on the [-1, 1] scale)"),  # diverged mid-run
    ("optim.lr=-0.1", "optim.lr=-0.1 must be >= 0 (0 freezes the weights)"),
    ("optim.weight_decay=-1", "optim.weight_decay=-1.0 must be >= 0"),
    ("optim.momentum=1", "optim.momentum=1.0 must be in [0, 1)"),
    ("optim.momentum=-0.1", "optim.momentum=-0.1 must be in [0, 1)"),
    (
        "optim.nesterov=true",
        "optim.nesterov=true with optim.name=adam, optim.momentum=0.9: Nesterov needs optim=sgd with "
        "optim.momentum > 0; or use optim.nesterov=false",
    ),
    (
        "optim=sgd optim.momentum=0 optim.nesterov=true",
        "optim.nesterov=true with optim.name=sgd, optim.momentum=0.0: Nesterov needs optim=sgd with "
        "optim.momentum > 0; or use optim.nesterov=false",
    ),
    ("optim.betas=[1.5,0.999]", "optim.betas[0]=1.5 must be in [0, 1)"),
    ("optim.betas=[0.9,nan]", "optim.betas[1]=nan must be in [0, 1)"),
    ("optim.betas=[0.9]", "optim.betas=[0.9] must be 2 values: Adam's beta1 and beta2, e.g. [0.9,0.999]"),
    (
        "optim.betas=[0.9,0.99,0.999]",
        "optim.betas=[0.9, 0.99, 0.999] must be 2 values: Adam's beta1 and beta2, e.g. [0.9,0.999]",
    ),
    ("sched.gamma=-1", "sched.gamma=-1.0 must be in (0, 1] (the factor at each milestone)"),
    ("sched.gamma=0", "sched.gamma=0.0 must be in (0, 1] (the factor at each milestone)"),
    ("sched.gamma=1.5", "sched.gamma=1.5 must be in (0, 1] (the factor at each milestone)"),
    ("sched.milestones=[0.5,1.0]", "sched.milestones[1]=1.0 must be in (0, 1) (a fraction of the epochs)"),
    ("sched.milestones=[0,0.5]", "sched.milestones[0]=0.0 must be in (0, 1) (a fraction of the epochs)"),
    ("sched.milestones=[inf]", "sched.milestones[0]=inf must be in (0, 1) (a fraction of the epochs)"),
    (
        "sched.milestones=[0.75,0.5]",
        "sched.milestones=[0.75, 0.5] must increase, each once: give sched.milestones=[0.5,0.75]",
    ),
    ("sched.milestones=[0.5,0.5]", "sched.milestones=[0.5, 0.5] must increase, each once: give sched.milestones=[0.5]"),
    ("sched.min_lr=-0.1", "sched.min_lr=-0.1 must be >= 0"),
    (
        "sched=cosine sched.min_lr=0.01",
        "sched.min_lr=0.01 must be in [0, 0.001]: cosine's floor, at most optim.lr (its start)",
    ),
    ("sched.base_lr=0", "sched.base_lr=0.0 must be > 0"),
    (
        "sched=cyclic sched.base_lr=0.001",
        "sched.base_lr=0.001 must be in (0, 0.001): the cycle's bottom, below optim.lr (its top)",
    ),
    (
        "sched=cyclic optim.lr=0",
        "sched.base_lr=0.0001 must be in (0, 0.0): the cycle's bottom, below optim.lr (its top)",
    ),
    ("sched.cycle_epochs=0", "sched.cycle_epochs=0.0 must be in (0, 2147483647]"),
    ("sched=cyclic sched.cycle_epochs=1e308", "sched.cycle_epochs=1e+308 must be in (0, 2147483647]"),  # overflowed
    ("sched=cyclic warmup_epochs=1", CYCLIC_WARMUP),
    ("parallel.nproc=0", "parallel.nproc=0 must be in [1, 2147483647] or null"),
    ("parallel.timeout_s=0", "parallel.timeout_s=0 must be in [1, 2147483647]"),
    ("parallel.timeout_s=100000000000000", "parallel.timeout_s=100000000000000 must be in [1, 2147483647]"),
    ("fault.kill_rank=-1", "fault.kill_rank=-1 must be >= 0 or null"),
    ("fault.kill_step=0", "fault.kill_step=0 must be >= 1"),
    ("fault.term_step=0", "fault.term_step=0 must be >= 1 or null"),
    ("fault.oom_step=0", "fault.oom_step=0 must be >= 1 or null"),
    ("fault.oom_min_batch=0", "fault.oom_min_batch=0 must be >= 1"),
    ("mlflow.experiment=", "mlflow.experiment='' must be a non-blank string"),
    (f"aug.name={'x' * 6001}", "aug.name is 6001 characters long: at most 6000 (MLflow's limit for a param value)"),
    (
        f"tags=[{','.join(f't{i:04d}' for i in range(700))}]",  # MLflow cut the run's tags param
        "tags is 6300 characters long: at most 6000 (MLflow's limit for a param value)",
    ),
    (
        "mlflow.system_metrics_interval_s=0.001",
        "mlflow.system_metrics_interval_s=0.001 must be in [1.0, 86400.0] (each sample writes to the store: 0.001 s "
        "slowed training 2.6x, docs/benchmarks.md)",
    ),
    (
        "mlflow.system_metrics_interval_s=1e308",  # MLflow's sampling thread failed on it, and sampled nothing
        "mlflow.system_metrics_interval_s=1e+308 must be in [1.0, 86400.0] (each sample writes to the store: 0.001 s "
        "slowed training 2.6x, docs/benchmarks.md)",
    ),
]


@pytest.mark.parametrize("overrides,message", BAD_VALUES, ids=[overrides for overrides, _ in BAD_VALUES])
def test_values_outside_their_range_are_refused_naming_key_and_value(overrides, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        OmegaConf.to_object(compose_config(*overrides.split(" ")))


@pytest.mark.parametrize(
    "override,message",
    [
        ("margin=-0.1", "margin=-0.1 must be in [0, 1] (an AUC difference)"),
        ("margin=1.5", "margin=1.5 must be in [0, 1] (an AUC difference)"),
        ("tags=[bad tag]", "tags: 'bad tag' is not a tag name: use letters, digits, _ and - (tags=[baseline,amp])"),
        ("register=team/best", "register=team/best: MLflow's model names cannot hold /"),
        ("register=a:b/c", "register=a:b/c: MLflow's model names cannot hold / or :"),
    ],
)
def test_report_values_outside_their_range_are_refused(override, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        OmegaConf.to_object(compose_report(override))


def float_keys(node: type, prefix: str = "") -> Iterator[str]:
    """Every float (or optional float) key of the schema dataclass ``node``, nested ones followed."""
    for name, hint in typing.get_type_hints(node).items():
        if dataclasses.is_dataclass(hint):
            yield from float_keys(hint, f"{prefix}{name}.")
        elif hint in (float, float | None):
            yield f"{prefix}{name}"


FLOAT_KEYS = [(compose_config, key) for key in float_keys(Config)] + [
    (compose_report, key) for key in float_keys(ReportConfig)
]


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("compose_with,key", FLOAT_KEYS, ids=[key for _, key in FLOAT_KEYS])
def test_every_float_key_refuses_nan_and_inf(compose_with, key, value):
    """OmegaConf parses ``nan`` and ``inf`` as floats, and ``nan < 0`` is False: each range checks finiteness."""
    with pytest.raises(ValueError, match=f"^{re.escape(f'{key}={value} must be ')}"):
        OmegaConf.to_object(compose_with(f"{key}={value}"))


BLANKABLE = [
    (compose_config, "data.root", False),
    (compose_config, "data.labels", True),
    (compose_config, "aug.name", False),
    (compose_config, "mlflow.experiment", False),
    (compose_config, "mlflow.tracking_uri", True),
    (compose_config, "rerun", True),
    (compose_config, "resume", True),
    (compose_report, "mlflow.tracking_uri", True),
    (compose_report, "mlflow.experiment", True),
    (compose_report, "sweep", True),
    (compose_report, "parent", True),
    (compose_report, "out", True),
    (compose_report, "register", True),
]


@pytest.mark.parametrize("compose_with,key,null", BLANKABLE, ids=[f"{c.__name__[8:]}-{key}" for c, key, _ in BLANKABLE])
def test_names_paths_and_uris_refuse_a_blank_string(compose_with, key, null):
    """Only spaces (an empty ``mlflow.experiment=`` is among BAD_VALUES)."""
    message = f"{key}='  ' must be a non-blank string{' or null' if null else ''}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        OmegaConf.to_object(compose_with(f"{key}='  '"))


@pytest.mark.parametrize(
    "overrides",
    [
        "optim.lr=0 sched=none",
        "optim=sgd optim.momentum=0",
        "optim=sgd optim.nesterov=true",
        "optim.betas=[0,0]",
        "sched.gamma=1 sched.milestones=[]",
        "sched=cosine sched.min_lr=0.001",
        "sched=cyclic sched.base_lr=0.0009",
        "seed=4294967295",
        "aug.affine_p=0 aug.affine_degrees=180 aug.affine_translate=1 aug.noise_std=0",
        "aug.noise_std=1 mlflow.system_metrics_interval_s=86400",
        "sched=cyclic sched.cycle_epochs=2147483647",
        "data.url=file:///tmp/a.npz",
        "data.url=https://zenodo.org/records/1/files/a.npz",
        "data=synthetic data.task=multi-class data.num_classes=3",
        "fault.kill_rank=0 fault.term_step=1 fault.oom_step=1",
        "parallel.timeout_s=1 mem_budget_mb=0.5",
    ],
)
def test_values_at_the_edges_of_their_ranges_pass(overrides):
    typed = OmegaConf.to_object(compose_config(*overrides.split(" ")))
    for override in overrides.split(" "):
        held, given = held_and_given(typed, override)
        assert held == given, override


@pytest.mark.parametrize("margin", ["0", "1"])
def test_report_margin_edges_pass(margin):
    assert OmegaConf.to_object(compose_report(f"margin={margin}")).margin == float(margin)


def test_the_name_limits_are_mlflows():
    from mlflow.utils import validation

    assert EXPERIMENT_NAME_MAX == validation.MAX_EXPERIMENT_NAME_LENGTH
    assert TAG_KEY_MAX == validation.MAX_ENTITY_KEY_LENGTH
    assert PARAM_VALUE_MAX == validation.MAX_PARAM_VAL_LENGTH
    for banned in MODEL_NAME_BANNED:
        with pytest.raises(MlflowException, match="Invalid model name"):
            validation._validate_model_name(f"best{banned}model")
    validation._validate_model_name("best model-1.0")  # the rest passes
