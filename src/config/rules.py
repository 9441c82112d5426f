"""A key of the schema declared once, on its dataclass field (:func:`key`): its default, one line of help, and the
rule its node's ``__post_init__`` enforces (:func:`check_keys`). The key reference (:mod:`src.config.reference`)
reads the same field, so docs/configuration.md shows the range the check enforces, never a copy of it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from omegaconf import MISSING

from src.config.ranges import bounds_text, filled, not_longer, within, within_each

ABOUT, RULE, ALLOWED = "about", "rule", "allowed"  # a field's metadata


class Rule(Protocol):
    def check(self, key: str, value: Any, node: Any) -> None:
        """Raise a ``ValueError`` naming ``key`` and ``value`` where ``value`` breaks the rule (``node``: the
        dataclass holding it)."""

    def text(self) -> str:
        """What the value must be, as the reference and the error say it."""


@dataclass(frozen=True)
class Range:
    """A number within ``low``..``high`` (:func:`within`), or with ``each``, a list of them (``count`` of them,
    ``what`` they are, if set: :func:`within_each`). A ``high`` that is a name is the key of the same node that bounds
    it (``warmup_epochs`` below ``epochs``). ``null``: None passes."""

    low: float
    high: float | str = math.inf
    ends: str = "[)"
    null: bool = False
    fix: str = ""  # what follows the error, in brackets: what the value means
    each: bool = False
    count: int | None = None
    what: str = ""

    def check(self, key: str, value: Any, node: Any) -> None:
        if self.each:
            if value is not None or not self.null:
                within_each(key, value, self.low, self.high, self.ends, count=self.count, what=self.what, fix=self.fix)
        elif isinstance(self.high, str):
            high = getattr(node, self.high)
            within(key, value, self.low, high, self.ends, null=self.null, fix=f" (below {self.high}={high})")
        else:
            within(key, value, self.low, self.high, self.ends, null=self.null, fix=self.fix)

    def text(self) -> str:
        if isinstance(self.high, str):
            shown = f"in {self.ends[0]}{self.low}, {self.high}{self.ends[1]}{' or null' if self.null else ''}"
        else:
            shown = bounds_text(self.low, self.high, self.ends, null=self.null and not self.each)
        if self.each:
            shown = (
                f"{f'{self.count} values' if self.count else 'a list'}, each {shown}{', or null' if self.null else ''}"
            )
        return shown


@dataclass(frozen=True)
class Text:
    """A non-blank string (:func:`filled`) of at most ``limit`` characters, ``whose`` limit it is (:func:`not_longer`);
    ``null``: None passes."""

    null: bool = False
    limit: int | None = None
    whose: str = ""

    def check(self, key: str, value: Any, node: Any) -> None:
        filled(key, value, null=self.null)
        if self.limit is not None:
            not_longer(key, value, self.limit, self.whose)

    def text(self) -> str:
        most = f" of at most {self.limit} characters" if self.limit is not None else ""
        return f"a non-blank string{most}{' or null' if self.null else ''}"


@dataclass(frozen=True)
class Pattern:
    """A string that ``pattern`` matches whole, ``what`` it is; ``null``: None passes (``fix``: what None means)."""

    pattern: re.Pattern[str]
    what: str
    null: bool = False
    fix: str = ""

    def check(self, key: str, value: Any, node: Any) -> None:
        if not (value is None and self.null) and not self.pattern.fullmatch(str(value)):
            raise ValueError(f"{key}={value!r} must be {self.text()}{self.fix}")

    def text(self) -> str:
        return f"{self.what}{', or null' if self.null else ''}"


@dataclass(frozen=True)
class OneOf:
    """One of ``choices`` (strings), which are ``what``."""

    choices: tuple[str, ...]
    what: str

    def check(self, key: str, value: Any, node: Any) -> None:
        if value not in self.choices:
            raise ValueError(f"{key}={value} is not {self.what}: use one of {', '.join(self.choices)}")

    def text(self) -> str:
        return f"one of {', '.join(self.choices)}"


@dataclass(frozen=True)
class Either:
    """``true``, ``false`` or one of ``names``, in the order ``words`` gives them (``auto``, ``true``, ``false``)."""

    words: tuple[str, ...]

    def check(self, key: str, value: Any, node: Any) -> None:
        if not isinstance(value, bool) and value not in set(self.words) - {"true", "false"}:
            raise ValueError(f"{key}={value} must be {self.text()}")

    def text(self) -> str:
        return f"{', '.join(self.words[:-1])} or {self.words[-1]}"


@dataclass(frozen=True)
class Finite:
    """A finite number (``fix``: what it is)."""

    fix: str = ""

    def check(self, key: str, value: Any, node: Any) -> None:
        if not math.isfinite(value):
            raise ValueError(f"{key}={value} must be {self.text()}{self.fix}")

    def text(self) -> str:
        return "a finite number"


def key(default: Any = MISSING, about: str = "", rule: Rule | None = None, allowed: str = "") -> Any:
    """A field of the schema: its ``default`` (a list is copied for each config), ``about`` it in one line, its
    ``rule`` (checked by :func:`check_keys`), and ``allowed``: what a check of its own in ``__post_init__`` enforces
    beyond the rule, as the reference says it."""
    metadata = {ABOUT: about, RULE: rule, ALLOWED: allowed}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def check_keys(node: Any, section: str = "") -> None:
    """Each field of ``node`` (a schema dataclass) against its :func:`key`'s rule, in the fields' order; ``section``:
    the node's own key (``data``), or none at the top level."""
    for declared in fields(node):
        if (rule := declared.metadata.get(RULE)) is not None:
            rule.check(f"{section}.{declared.name}" if section else declared.name, getattr(node, declared.name), node)
