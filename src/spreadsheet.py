"""The one writer of the CSV files medsweep writes (the report's ``runs.csv`` and ``effects.csv``, a run's
``eval/test_predictions.csv``), made to be opened in a spreadsheet: no cell can run as a formula there (CSV
injection), and no cell shows a secret of a URI.

A text cell (a header too) whose first character, past any spaces, starts a formula in Excel, LibreOffice or Google
Sheets (``=``, ``+``, ``-``, ``@``, their full-width forms, or a tab, carriage return or line feed) is written after a
``'``, which makes it text, as OWASP advises; a number stays a number, in a number column or written as text
(``-0.5``, ``1e-3``). Read back with pandas or :mod:`csv`, such a cell starts with the ``'``. Lines end in CR LF
(RFC 4180), so a cell holding a line break is quoted and stays one cell.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from src.redaction import redact

FORMULA_START = frozenset("=+-@\uff1d\uff0b\uff0d\uff20")  # and their full-width forms (Excel reads those too)
CONTROL_START = frozenset("\t\r\n")
NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")  # a decimal number: what stays as it is
TEXT_PREFIX = "'"
TEXT_KINDS = ("object", "string", "str", "category")  # pandas' dtypes that can hold text
LINE_END = "\r\n"  # RFC 4180's: a cell holding a CR or LF is then quoted (with "\n" alone a CR is not: rows break)


def inert(value: Any) -> Any:
    """A cell as the CSV holds it: a text one with its secrets as ``***`` and, where a spreadsheet would read it as a
    formula, after a ``'``; any other value unchanged."""
    if not isinstance(value, str):
        return value
    text = redact(value)
    starts_formula = text[:1] in CONTROL_START or text.lstrip(" ")[:1] in FORMULA_START
    return TEXT_PREFIX + text if starts_formula and not NUMBER.fullmatch(text.strip()) else text


def write_csv(frame: Any, path: Path, **options: Any) -> None:
    """``frame`` (a pandas DataFrame) to ``path`` without its index, every text cell and header :func:`inert`;
    ``options``: more of :meth:`pandas.DataFrame.to_csv`'s (``float_format``)."""
    safe = frame.copy()
    for i, kind in enumerate(frame.dtypes):
        if str(kind) in TEXT_KINDS:  # a number column holds no text
            safe.isetitem(i, frame.iloc[:, i].map(inert))
    safe.columns = [inert(str(name)) for name in frame.columns]
    safe.to_csv(path, index=False, lineterminator=LINE_END, **options)
