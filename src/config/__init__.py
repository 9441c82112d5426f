"""The typed config schemas (Hydra structured configs); no torch import, Hydra only in :func:`store_schema`.

Each key is declared once, on its dataclass field (:func:`src.config.rules.key`): its default, one line of help and
its range, which the dataclass's ``__post_init__`` enforces, refusing a value outside it (NaN and inf included) with a
``ValueError`` naming the key, the value and the range; ``python -m src.<command>`` prints it as one ``error:`` line
before it starts. docs/configuration.md's key table is generated from the same fields (:mod:`src.config.reference`).

- :mod:`~src.config.ranges`: the keys' limits and the checks of a value against them
- :mod:`~src.config.rules`: a key's declaration and its rule (range, text, pattern, choice)
- :mod:`~src.config.enums`: the choices
- :mod:`~src.config.tags`: the tags a user names, against medsweep's own
- :mod:`~src.config.data`, :mod:`~src.config.model`, :mod:`~src.config.training`, :mod:`~src.config.tracking`,
  :mod:`~src.config.run`: the sections of a run's :class:`Config`; :mod:`~src.config.report`: ``src.report``'s
"""

from __future__ import annotations

from src.config.data import (
    MEDMNIST_SIZES,
    NIFTI,
    NIFTI_KEYS,
    NIFTI_SIZES,
    SPLITS,
    SYNTHETIC,
    TASKS,
    URL,
    DataConfig,
)
from src.config.enums import (
    Activation,
    AmpDtype,
    Backend,
    CheckpointKeep,
    Device,
    GpuShare,
    Init,
    InitMode,
    Intensity,
    Loader,
    Norm,
    OptimName,
    ParallelMode,
    SchedName,
    SelectBy,
    Shortcut,
    Stem,
)
from src.config.model import ModelConfig
from src.config.ranges import (
    CHANNELS_MAX,
    CLASSES_MAX,
    COUNT_MAX,
    EXPERIMENT_NAME_MAX,
    MODEL_NAME_BANNED,
    NIFTI_SPACING_MAX,
    PARAM_VALUE_MAX,
    SAMPLE_INTERVAL_MAX_S,
    SAMPLE_INTERVAL_MIN_S,
    SEED_MAX,
    TAG_KEY_MAX,
    THREADS_MAX,
    WORKERS_MAX,
    check_unread,
    filled,
    not_longer,
    within,
    within_each,
)
from src.config.report import ReportConfig, ReportMlflowConfig
from src.config.run import (
    OBJECTIVES,
    CheckpointConfig,
    Config,
    FaultConfig,
    ParallelConfig,
    check_early_stop,
    check_param_lengths,
    check_schedule,
)
from src.config.tags import RESERVED_TAGS, TAG_NAME, check_tags
from src.config.tracking import MlflowConfig, StoreConfig
from src.config.training import AugConfig, OptimConfig, SchedConfig

__all__ = [
    "CHANNELS_MAX",
    "CLASSES_MAX",
    "COUNT_MAX",
    "EXPERIMENT_NAME_MAX",
    "MEDMNIST_SIZES",
    "MODEL_NAME_BANNED",
    "NIFTI",
    "NIFTI_KEYS",
    "NIFTI_SIZES",
    "NIFTI_SPACING_MAX",
    "OBJECTIVES",
    "PARAM_VALUE_MAX",
    "RESERVED_TAGS",
    "SAMPLE_INTERVAL_MAX_S",
    "SAMPLE_INTERVAL_MIN_S",
    "SEED_MAX",
    "SPLITS",
    "SYNTHETIC",
    "TAG_KEY_MAX",
    "TAG_NAME",
    "TASKS",
    "THREADS_MAX",
    "URL",
    "WORKERS_MAX",
    "Activation",
    "AmpDtype",
    "AugConfig",
    "Backend",
    "CheckpointConfig",
    "CheckpointKeep",
    "Config",
    "DataConfig",
    "Device",
    "FaultConfig",
    "GpuShare",
    "Init",
    "InitMode",
    "Intensity",
    "Loader",
    "MlflowConfig",
    "ModelConfig",
    "Norm",
    "OptimConfig",
    "OptimName",
    "ParallelConfig",
    "ParallelMode",
    "ReportConfig",
    "ReportMlflowConfig",
    "SchedConfig",
    "SchedName",
    "SelectBy",
    "Shortcut",
    "Stem",
    "StoreConfig",
    "check_early_stop",
    "check_param_lengths",
    "check_schedule",
    "check_tags",
    "check_unread",
    "filled",
    "not_longer",
    "store_schema",
    "within",
    "within_each",
]


def store_schema() -> None:
    """Store the schema in Hydra's ConfigStore: :class:`Config` as ``base_config``, which ``conf/config.yaml``
    composes on (every group file is merged into a typed node: a wrong key, type or choice fails at composition), and
    :class:`ReportConfig` as ``base_report`` (``conf/report.yaml``'s). The resolvers ``conf/`` uses are registered by
    their owners (:func:`src.cli.register`)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=Config)
    ConfigStore.instance().store(name="base_report", node=ReportConfig)
