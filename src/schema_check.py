"""Keys the schema does not declare, values outside its ranges, and Hydra's composition errors, as one line.

Hydra's ``+key=value`` force-adds a key even into a typed node, so after composition every node typed with a
dataclass of :mod:`src.config` may hold only that dataclass's fields; any other key, at any depth, is refused with one
:class:`UsageError` line naming it, its override and the valid keys. The values are then checked by the schema's own
``__post_init__`` (:func:`check_values`)."""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
import unicodedata
from collections.abc import Iterator, Sequence
from typing import Any

from antlr4.error.Errors import LexerNoViableAltException
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from src.errors import UsageError, one_line

HYDRA_NODE = "hydra"  # Hydra's own settings beside the schema (in a callback's config): Hydra checks them
GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"
DELIMITERS = ",[]{}():'\"="  # what ends an element of a value in Hydra's grammar: a list's, a sweep's, a dict's
SHELL_SPECIAL = "$`\\!"  # what a shell expands inside double quotes: an override holding one is quoted otherwise


def schema_fields(node: Any) -> list[str] | None:
    """The fields of the dataclass ``node`` is typed with; None for an untyped node or a plain value."""
    schema = node._metadata.object_type if isinstance(node, DictConfig) else None
    return [field.name for field in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None


def dotted(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def typed_nodes(node: DictConfig, path: str = "") -> Iterator[tuple[str, DictConfig, list[str]]]:
    """``(dotted path, node, its dataclass's fields)`` for ``node`` and each node under it typed with a dataclass,
    Hydra's own settings left out."""
    if (fields := schema_fields(node)) is not None:
        yield path, node, fields
    for key in node:
        if dotted(path, key) != HYDRA_NODE and isinstance(child := node._get_node(key), DictConfig):
            yield from typed_nodes(child, dotted(path, key))


def unknown_keys(cfg: DictConfig) -> Iterator[tuple[str, DictConfig]]:
    """``(dotted key, the typed node holding it)`` for each key outside its node's dataclass."""
    for path, node, fields in typed_nodes(cfg):
        yield from ((dotted(path, key), node) for key in node if key not in fields and dotted(path, key) != HYDRA_NODE)


def deleted_keys(cfg: DictConfig) -> Iterator[str]:
    """The dotted keys of a dataclass's fields that ``~key`` deleted from their node (a mandatory value that is
    missing is still there: its own error)."""
    for path, node, fields in typed_nodes(cfg):
        kept = set(node)
        yield from (dotted(path, name) for name in fields if name not in kept)


def override_key(override: str) -> str:
    """``+model.colour=red`` -> ``model.colour``."""
    return override.lstrip("+~").partition("=")[0]


def unknown_key_message(key: str, schema: type, overrides: Sequence[str]) -> str:
    """``unknown key model.colour (forced with +model.colour=red): ModelConfig has no such key; ...: <the fix>``."""
    parent, _, name = key.rpartition(".")
    fields = [field.name for field in dataclasses.fields(schema)]
    given = next((o for o in overrides if f"{override_key(o)}.".startswith(f"{key}.")), None)
    origin = f" ({'forced with' if given.startswith('+') else 'set by'} {given})" if given else ""
    close = difflib.get_close_matches(name, fields, n=3)
    fix = (
        f"did you mean {' or '.join(f'{parent}.{c}' if parent else c for c in close)}?"
        if close
        else f"{f'keys of {parent}' if parent else 'top-level keys'}: {', '.join(fields)}: fix the spelling"
    )
    return f"unknown key {key}{origin}: {schema.__name__} has no such key; {fix}"


def check_known_keys(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Refuse the first key the schema does not declare: in the composed ``cfg``, or in a swept ``+key=a,b``
    (Hydra composes swept values only per job, after a sweep has started: its key is followed through ``cfg``)."""
    for key, node in unknown_keys(cfg):
        raise UsageError(unknown_key_message(key, node._metadata.object_type, overrides))
    for key in deleted_keys(cfg):
        given = next((o for o in overrides if o.startswith("~") and override_key(o) == key), f"~{key}")
        raise UsageError(
            f"{given}: a key of the schema cannot be deleted (the job would run on its default, logged without "
            f"it): set {key} to the value wanted, or drop {given}"
        )
    for key in swept_keys(overrides):
        _check_path(cfg, key, overrides)


def swept_keys(overrides: Sequence[str]) -> Iterator[str]:
    """The keys that ``+key=a,b`` or ``++key=a,b`` sweeps add; a config group (``+group=a,b``) is no key."""
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if override.is_sweep_override() and (override.is_add() or override.is_force_add()):
            key = override.key_or_group
            if "/" in key or key.partition(".")[0] == HYDRA_NODE:
                continue
            if key not in GlobalHydra.instance().config_loader().list_groups(""):
                yield key


def _check_path(cfg: DictConfig, key: str, overrides: Sequence[str]) -> None:
    node, parts = cfg, key.split(".")
    for depth, part in enumerate(parts):
        fields = schema_fields(node)
        if fields is not None and part not in fields:
            raise UsageError(unknown_key_message(".".join(parts[: depth + 1]), node._metadata.object_type, overrides))
        if not isinstance(node, DictConfig) or part not in node:
            return
        node = node._get_node(part)


def unreadable_override(text: str) -> str | None:
    """Why Hydra's override grammar cannot read a character of the override ``text``, as one line naming it and the
    fix; None where it reads them all (its other errors: Hydra's own message). Unquoted, a value takes ASCII letters,
    digits and a few signs only: a character outside them (any non-ASCII one: ``tags.x=模型``, ``résumé``, a
    no-break space; ``;``, ``#``, ``&`` ...) is read in quotes, so the line gives the override with that element
    quoted, as a shell passes it on. Hydra said only ``token recognition error at: '模'``."""
    try:
        OverridesParser.create().parse_override(text)
    except OverrideParseException:  # read, then refused by Hydra's own check of the override: composition says why
        return None
    except HydraException as err:
        return unreadable(text, err)
    return None


def unreadable(text: str, err: HydraException) -> str | None:
    cause, key_end = err.__cause__, text.find("=")
    at = cause.startIndex if isinstance(cause, LexerNoViableAltException) else None
    if at is None or not 0 <= at < len(text):  # a parser's error: Hydra's own message
        return None
    char = text[at]
    plain = char.isprintable() and not char.isspace() and unicodedata.category(char) not in ("Mn", "Me")
    shown = f"{char!r}" if plain else unicodedata.name(char, "a character")
    shown += f" (U+{ord(char):04X})"
    if char in "'\"":  # an apostrophe in a word (l'été) opens a string the value does not close
        key, _, value = text.partition("=")
        mark = "'" if char == '"' else '"'
        fixed = f"{key}={mark}{value}{mark}"
        if key_end < at and mark not in value and reads(fixed):
            return (
                f"{text}: {shown} opens a quoted string in Hydra's override grammar, which the value does not close: "
                f"quote the value: {shell_quoted(fixed)}"
            )
        return None
    if key_end < 0 or at < key_end:
        return (
            f"{text}: a key is ASCII letters, digits, '_', '-' and '.', and {shown} is not one: check its spelling "
            "(docs/configuration.md lists every key)"
        )
    rule = (
        f"takes only ASCII in an unquoted value, and {shown} is not"
        if not char.isascii()
        else f"takes {shown} only in a quoted value"
    )
    fix = quoted_element(text, at, key_end)
    if fix is None:
        return f"{text}: Hydra's override grammar {rule}: quote the value (see {GRAMMAR})"
    ascii_form = unicodedata.normalize("NFKC", text)  # a full-width digit, a no-break space: as typed in ASCII
    plain = f", or type it in ASCII: {shell_quoted(ascii_form)}" if ascii_form.isascii() and reads(ascii_form) else ""
    return f"{text}: Hydra's override grammar {rule}: quote it: {shell_quoted(fix)}{plain}"


def list_index_error(err: ValueError, overrides: Sequence[str]) -> str | None:
    """The line of an override whose key names an element of a list (``tags.x=a``: ``tags`` is a list of names),
    which OmegaConf fails on in a traceback (``invalid literal for int() ...: 'x'``); None for another error."""
    found = re.fullmatch(r"invalid literal for int\(\) with base 10: '(.*)'", str(err))
    if not found:
        return None
    for override in overrides:
        parts = override.partition("=")[0].lstrip("+~").split(".")
        if found[1] in parts[1:]:
            where = ".".join(parts[: parts.index(found[1], 1)])
            return (
                f"{override}: {where} is a list, its elements numbered ({where}.0, {where}.1 ...), none named "
                f"{found[1]!r}: give the whole list, {where}=[...]"
            )
    return None


def shell_quoted(override: str) -> str:
    """``override`` as a shell passes it on unchanged: in double quotes (its own ``"`` escaped), or quoted by
    :func:`shlex.quote` where it holds what a shell expands inside them."""
    if set(override) & set(SHELL_SPECIAL):
        return shlex.quote(override)
    escaped = override.replace('"', '\\"')
    return f'"{escaped}"'


def reads(override: str) -> bool:
    """Whether Hydra's override grammar reads ``override``."""
    try:
        OverridesParser.create().parse_override(override)
    except HydraException:
        return False
    return True


def quoted_element(text: str, at: int, key_end: int) -> str | None:
    """``text`` with the element of its value that holds position ``at`` quoted (``tags=[a,'模型']``), where Hydra
    then reads it; None where it does not."""
    start = at
    while start > key_end + 1 and text[start - 1] not in DELIMITERS:
        start -= 1
    end = at
    while end < len(text) and text[end] not in DELIMITERS:
        end += 1
    element = text[start:end].strip()
    if not element:
        return None
    start = text.index(element, start)
    mark = "'" if "'" not in element else '"' if '"' not in element else None
    if mark is None:
        return None
    fixed = f"{text[:start]}{mark}{element}{mark}{text[start + len(element) :]}"
    return fixed if reads(fixed) else None


def composition_error(err: Exception, overrides: Sequence[str]) -> str:
    """Hydra's composition error as one line naming the bad value and the fix."""
    if isinstance(err, MissingConfigException) and err.options and "/" in (err.missing_cfg_file or ""):
        group, _, option = err.missing_cfg_file.rpartition("/")
        return f"{group}={option} is not an option of {group}: use one of {', '.join(err.options)}"
    cause = err.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and dataclasses.is_dataclass(cause.object_type):
        return unknown_key_message(cause.full_key, cause.object_type, overrides)  # an override of no schema key
    if isinstance(err, OverrideParseException) and (unread := unreadable_override(err.override)):
        return unread
    texts = [f"cannot parse the override {err.override}"] if isinstance(err, OverrideParseException) else []
    texts += [str(err)] + ([str(cause)] if isinstance(cause, OmegaConfBaseException) else [])
    lines = [line for text in texts for line in text.split("Config search path:")[0].splitlines()]
    return "; ".join(line.strip().rstrip(".") for line in lines if line.strip() and not line[0].isspace())


def check_values(cfg: DictConfig) -> Any:
    """The typed schema's checks (types, mandatory values, each ``__post_init__``'s ranges) as one-line
    :class:`UsageError`s; the typed config."""
    try:
        return OmegaConf.to_object(cfg)
    except (ValueError, MissingMandatoryValue, InterpolationResolutionError) as err:
        raise one_line(err) from None
