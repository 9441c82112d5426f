"""The model registry: ``@register_model(...)`` files a builder under its function name (as timm does), with the
switches it acts on and its defaults, and stores it as the ``model=<name>`` option of Hydra's ``model`` group;
``${models:}`` names every registered model, comma-separated (``preset=models``' sweep)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from torch import nn

from src.config import ModelConfig
from src.errors import UsageError

Builder = TypeVar("Builder", bound=Callable[..., nn.Module])

# every builder takes these, as its ``stem``, ``layers``, ``init`` and ``init_mode`` arguments (models.model_kwargs)
LAYER_SWITCHES = ("stem", "dsconv", "dsconv_mid_norm", "activation", "norm", "inplace_act", "init", "init_mode")
DEFAULTS = {field.name: field.default for field in dataclasses.fields(ModelConfig) if field.name != "name"}
OWN_SWITCHES = tuple(key for key in DEFAULTS if key not in LAYER_SWITCHES)  # a builder takes those it declares


@dataclasses.dataclass(frozen=True)
class Model:
    """A registered model: its builder, the switches beyond the layer switches that it acts on, its defaults."""

    build: Callable[..., nn.Module]
    switches: tuple[str, ...]
    defaults: dict[str, Any]


MODELS: dict[str, Model] = {}
if not OmegaConf.has_resolver("models"):  # read as it resolves: a model registered later is swept too
    OmegaConf.register_new_resolver("models", lambda: ",".join(MODELS))


def register_model(switches: Iterable[str] = (), **defaults: Any) -> Callable[[Builder], Builder]:
    """``@register_model(switches, **defaults)`` makes ``builder`` the model ``builder.__name__`` and the ``model``
    group's option of that name: :class:`ModelConfig` with ``defaults`` (of its switches or the layer switches).

    The builder takes ``in_channels``, ``num_classes``, ``stem`` (resolved), ``layers``, ``init``, ``init_mode``
    and each of ``switches`` (among :data:`OWN_SWITCHES`), as keywords.
    """
    switches = tuple(switches)

    def register(builder: Builder) -> Builder:
        name = builder.__name__
        if not set(switches) <= set(OWN_SWITCHES) or not set(defaults) <= {*LAYER_SWITCHES, *switches}:
            raise ValueError(
                f"{name}: switches must be among {OWN_SWITCHES}, defaults among its switches and {LAYER_SWITCHES}"
            )
        MODELS[name] = Model(builder, switches, defaults)
        ConfigStore.instance().store(group="model", name=name, node=ModelConfig(name=name, **defaults))
        return builder

    return register


def check_model(cfg: ModelConfig) -> None:
    """Refuse a model that is not registered, and a switch it ignores set off its default (a run that would train
    the same as the default under another config hash)."""
    if cfg.name not in MODELS:
        raise UsageError(f"model.name={cfg.name} is not a registered model: use one of {', '.join(MODELS)}")
    acts_on = MODELS[cfg.name].switches
    ignored = [key for key in OWN_SWITCHES if key not in acts_on and getattr(cfg, key) != DEFAULTS[key]]
    if not ignored:
        return
    given = ", ".join(f"model.{key}={override_value(getattr(cfg, key))}" for key in ignored)
    it = "it" if len(ignored) == 1 else "them"
    users = [name for name, model in MODELS.items() if set(ignored) <= set(model.switches)]
    elsewhere = f", or use a model that acts on {it}: {', '.join(users)}" if users else ""
    raise UsageError(f"{given}: model={cfg.name} ignores {it}; drop {it}{elsewhere}")


def override_value(value: Any) -> str:
    """A value as an override spells it: ``true``, ``A``."""
    return value.name if isinstance(value, Enum) else str(value).lower()
