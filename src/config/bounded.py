"""Files medsweep reads that anyone may have written: read bounded, so none can hang a command or fill its memory.

:func:`read_bounded` reads a regular file of at most a given size, never blocking (a pipe in its place is not read);
:func:`load_yaml` loads every YAML medsweep reads outside ``conf/`` (a run's ``.hydra/config.yaml`` artifact for
``rerun=``, a sweep folder's ``multirun.yaml`` or a job's ``.hydra/config.yaml`` for the report, the presets the
reference tables list) as :meth:`OmegaConf.load` does, its floats and its refusal of a key given twice, but safely
(no ``python/`` tag: they build objects) and within limits: :data:`MAX_BYTES`, :data:`MAX_VALUES` values once its
aliases are expanded (a "billion laughs" is a few hundred bytes whose aliases expand to 10^9 strings: OmegaConf built
them all, for minutes) and :data:`MAX_DEPTH` levels, no alias inside its own anchor. A file past them is
:class:`Refused`, one line naming it; Hydra writes a config of a few KB, a few hundred values.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf._utils import get_yaml_loader

from src.errors import UsageError

MAX_BYTES = 2**20  # pure-Python YAML parses ~0.3 MB/s (2026-11-29, 2-core EPYC): a refusal within seconds
MAX_VALUES = 20_000  # a config.yaml Hydra writes holds ~250 values, a multirun.yaml ~500
MAX_DEPTH = 64


class Unfit(ValueError):
    """A file :func:`read_bounded` does not read: why, in words (``is a folder, not a file``)."""


class Refused(UsageError):
    """A YAML file :func:`load_yaml` does not load: one line naming it and why."""


def read_bounded(path: Path, limit: int) -> bytes:
    """``path``'s bytes, a regular file of at most ``limit`` bytes; :class:`Unfit` where it is another kind of file or
    larger, an :class:`OSError` where it cannot be opened (``FileNotFoundError``: absent)."""
    handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(handle).st_mode
        if not stat.S_ISREG(mode):
            raise Unfit(f"is {kind(mode)}, not a file")
        data = b""
        while len(data) <= limit and (more := os.read(handle, limit + 1 - len(data))):
            data += more
    finally:
        os.close(handle)
    if len(data) > limit:
        raise Unfit(f"holds more than {limit} bytes")
    return data


def kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is that is not a regular file, in words."""
    return "a folder" if stat.S_ISDIR(mode) else "a pipe" if stat.S_ISFIFO(mode) else "a device or socket"


class _TooDeep(Exception):
    pass


def _loader_class() -> type:
    """OmegaConf's YAML loader (a ``SafeLoader``: its floats, no timestamps, a key given twice refused) without the
    ``python/`` tags it adds, nesting at most :data:`MAX_DEPTH` levels."""
    base = get_yaml_loader()

    class Loader(base):  # type: ignore[misc, valid-type]
        yaml_constructors = {
            tag: construct
            for tag, construct in base.yaml_constructors.items()
            if tag is None or not tag.startswith("tag:yaml.org,2002:python/")
        }
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    raise _TooDeep
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    return Loader


def yaml_children(node: yaml.Node) -> list[yaml.Node] | None:
    """A composed YAML node's keys and values (a mapping's, merge keys' included), or items; None for a scalar."""
    if isinstance(node, yaml.ScalarNode):
        return None
    return [child for pair in node.value for child in pair] if isinstance(node, yaml.MappingNode) else node.value


def python_children(node: Any) -> list[Any] | None:
    """A dict's keys and values, or a list's or tuple's items; None for anything else."""
    if isinstance(node, dict):
        return [*node.keys(), *node.values()]
    return list(node) if isinstance(node, list | tuple) else None


def expanded_values(root: Any, children: Callable[[Any], list[Any] | None], repeats: str) -> int:
    """How many values ``root`` holds once each of its ``repeats`` (YAML aliases, merge keys: a node counted wherever
    it is referred to) is a copy, counted without making any (``children``: a node's, None for a leaf);
    :class:`Unfit` past :data:`MAX_VALUES` values or :data:`MAX_DEPTH` levels, or for a node inside itself."""
    counted: dict[int, tuple[int, int]] = {}  # a node's values and levels, counted once
    inside: set[int] = set()

    def count(node: Any, depth: int) -> tuple[int, int]:
        if (below := children(node)) is None:
            return 1, 0
        if id(node) in inside:
            raise Unfit(f"refers to itself (one of its {repeats} inside what it names: an endless config)")
        if id(node) not in counted:
            inside.add(id(node))
            sizes = [count(child, depth + 1) for child in below]
            counted[id(node)] = 1 + sum(n for n, _ in sizes), 1 + max((levels for _, levels in sizes), default=0)
            inside.discard(id(node))
        values, levels = counted[id(node)]
        if depth + levels > MAX_DEPTH:
            raise Unfit(f"nests deeper than {MAX_DEPTH} levels once its {repeats} are expanded")
        if values > MAX_VALUES:
            raise Unfit(
                f"holds more than {MAX_VALUES} values once its {repeats} are expanded (an alias bomb: a few hundred "
                "bytes, billions of values)"
            )
        return values, levels

    return count(root, 0)[0]


def bounded_tree(tree: Any, what: str) -> Any:
    """``tree`` (a config as plain Python, unpickled: an object pickled once is shared wherever it is referred to)
    when it is within the limits, before OmegaConf copies every reference; :class:`Refused` (``what`` and why)
    otherwise."""
    try:
        expanded_values(tree, python_children, "shared references")
    except Unfit as err:
        raise Refused(f"{what} {err}: not read") from None
    return tree


def load_yaml(path: Path, what: str | None = None) -> DictConfig:
    """``path``'s YAML mapping as a :class:`DictConfig` (an empty file: an empty one), loaded within the limits;
    :class:`Refused` (``what``, default the path, and why) past them, or where it is not a regular file; a
    :class:`yaml.YAMLError` where it is not YAML (a python tag, text in another encoding) or not a mapping; an
    :class:`OSError` where it cannot be read."""
    what = what or str(path)
    loader = None
    try:
        loader = _loader_class()(read_bounded(path, MAX_BYTES))
        node = loader.get_single_node()  # composed: aliases are the node of their anchor, nothing copied yet
        if node is not None:
            expanded_values(node, yaml_children, "YAML aliases")
        tree = None if node is None else loader.construct_document(node)
    except Unfit as err:
        raise Refused(f"{what} {err}: not read") from None
    except (_TooDeep, RecursionError):
        raise Refused(f"{what} nests deeper than {MAX_DEPTH} levels: not read") from None
    finally:
        if loader is not None:
            loader.dispose()
    if tree is not None and not isinstance(tree, dict):
        raise yaml.YAMLError(f"a config is a mapping of keys, not a YAML {type(tree).__name__}")
    return OmegaConf.create(tree or {})
