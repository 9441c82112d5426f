"""The key reference (``src/config/reference.py``): a row for every key a run logs, each range the one its check
enforces, and generated blocks written between their markers."""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator
from typing import Any

import pytest
from omegaconf import OmegaConf

from src.config import Config, ReportConfig
from src.config.ranges import bounds_text
from src.config.reference import begin, blocks_in, end, key_table, rows, with_blocks
from src.config.rules import RULE, Either, Finite, OneOf, Pattern, Range, Rule, Text
from src.tracking.identity import flatten
from tests.helpers import compose_config, compose_report

ADDED_SINCE_THE_HAND_WRITTEN_PAGE = ("sched.min_lr", "sched.base_lr", "parallel.timeout_s", "optim.nesterov")


def test_the_key_table_has_a_row_for_every_key_a_run_or_report_logs():
    """The table's keys are the params a run logs (``flatten``), in their order: none missing, none extra."""
    assert [row[0] for row in rows(Config)] == list(flatten(compose_config()))
    assert [row[0] for row in rows(ReportConfig)] == list(flatten(compose_report()))
    table = key_table(Config)
    for key in (*ADDED_SINCE_THE_HAND_WRITTEN_PAGE, "fault.term_step", "log_every"):
        assert f"| `{key}` |" in table


def test_each_row_shows_the_default_and_a_line_of_help():
    shown = {key: (default, about) for key, default, _, about in rows(Config)}
    assert shown["data.size"][0] == "`28`" and shown["model.stem"][0] == "`standard`"
    assert shown["tags"][0] == "`[]`" and shown["ema_decay"][0] == "`null`" and shown["amp"][0] == "`false`"
    assert shown["model.name"][0] == "set by `model=<option>`"
    assert all(about for _, about in shown.values())


def declared(typed: Any, prefix: str = "") -> Iterator[tuple[str, Any, str, Any, Rule]]:
    """``(key, the node holding it, its field's name, its type, its rule)`` of each key of ``typed`` with a rule."""
    hints = typing.get_type_hints(type(typed))
    for field in dataclasses.fields(typed):
        value = getattr(typed, field.name)
        if dataclasses.is_dataclass(value):
            yield from declared(value, f"{prefix}{field.name}.")
        elif (rule := field.metadata.get(RULE)) is not None:
            yield f"{prefix}{field.name}", typed, field.name, hints[field.name], rule


def outside(rule: Rule, kind: Any, node: Any) -> Iterator[tuple[Any, str]]:
    """Values the rule refuses, each with what its error must say for the reference's range (``rule.text()``) to be
    the one enforced."""
    if isinstance(rule, Range):
        integer = int in (typing.get_args(kind) or (kind,)) or kind == list[int]
        step = 1 if integer else 0.5
        high = getattr(node, rule.high) if isinstance(rule.high, str) else rule.high
        shown = rule.text().replace(rule.high, str(high)) if isinstance(rule.high, str) else rule.text()
        edges = [rule.low if rule.ends[0] == "(" else rule.low - step]
        edges += [high if rule.ends[1] == ")" else high + step] if math.isfinite(high) else []
        for value in edges:
            if rule.each:
                values = [value] * (rule.count or 1)
                assert bounds_text(rule.low, rule.high, rule.ends) in rule.text()
                yield values, f"[0]={value} must be {bounds_text(rule.low, rule.high, rule.ends)}"
            else:
                yield value, f"={value} must be {shown}"
    elif isinstance(rule, Text):
        yield "  ", f"='  ' must be {rule.text().replace(f' of at most {rule.limit} characters', '')}"
        if rule.limit is not None:
            assert f"at most {rule.limit} characters" in rule.text()
            yield "x" * (rule.limit + 1), f" is {rule.limit + 1} characters long: at most {rule.limit}"
    elif isinstance(rule, OneOf | Either):
        yield "nothing-of-the-kind", rule.text().removeprefix("one of ")
    elif isinstance(rule, Pattern):
        yield "ftp://x/a.npz", f"='ftp://x/a.npz' must be {rule.text()}"
    elif isinstance(rule, Finite):
        yield math.nan, f"=nan must be {rule.text()}"


CONFIGS = {
    "config": lambda: OmegaConf.to_object(compose_config()),
    "nifti": lambda: OmegaConf.to_object(compose_config("data=nifti")),  # its own data.size
    "report": lambda: OmegaConf.to_object(compose_report()),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_the_range_the_table_shows_is_the_one_its_check_enforces(name):
    """For each key with a rule, a value outside the range the table shows is refused, and the error says that
    range: the reference and the check read the one declaration."""
    checked = 0
    for key, node, field, kind, rule in declared(CONFIGS[name]()):
        for value, said in outside(rule, kind, node):
            with pytest.raises(ValueError) as refused:
                dataclasses.replace(node, **{field: value})  # the node's __post_init__
            assert said in str(refused.value) and str(refused.value).startswith(key), (key, value)
            checked += 1
    assert checked > (60 if name != "report" else 10)


def test_blocks_are_written_between_their_markers_in_a_line_or_on_lines_of_their_own():
    page = f"a {begin('count')}3{end('count')} b\n\n{begin('table')}\n| old |\n{end('table')}\nprose\n"
    assert blocks_in(page) == ["count", "table"]
    contents = {"count": "11", "table": "| new |\n|---|"}
    written = with_blocks(page, contents)
    table = f"{begin('table')}\n\n| new |\n|---|\n\n{end('table')}"
    assert written == f"a {begin('count')}11{end('count')} b\n\n{table}\nprose\n"
    assert with_blocks(written, contents) == written


def test_a_block_without_its_end_or_generator_is_refused():
    with pytest.raises(ValueError, match="has no end marker <!-- /table -->"):
        with_blocks(f"{begin('table')}\n| old |\n", {"table": ""})
    with pytest.raises(KeyError, match="table: no such generated block"):
        with_blocks(f"{begin('table')}\n{end('table')}", {"keys": ""})
