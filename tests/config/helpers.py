"""What the config tests share."""

from __future__ import annotations

from dataclasses import is_dataclass
from enum import Enum
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser

from src.config import ParallelConfig


def held_and_given(typed: Any, override: str) -> tuple[Any, Any]:
    """What the typed config ``typed`` holds at ``override``'s key, and what ``override`` gives as Hydra parses it: an
    enum by its override name, a group (``optim=sgd``) by its option's name (``parallel``: its mode)."""
    parsed = OverridesParser.create().parse_override(override)
    held = typed
    for part in parsed.key_or_group.split("."):
        held = getattr(held, part)
    if is_dataclass(held):
        held = held.mode if isinstance(held, ParallelConfig) else held.name
    return (held.name if isinstance(held, Enum) else held), parsed.value()
