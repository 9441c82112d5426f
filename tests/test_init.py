"""What importing ``src`` sets up for every process: here, its exit without the interpreter's full collections."""

from __future__ import annotations

import sys

from tests.helpers import run_process

EXITING = """
import atexit, gc
import src
garbage = [[object()] for _ in range(1000)]
atexit._run_exitfuncs()  # what the interpreter's exit runs before it collects
print(gc.get_freeze_count() >= len(garbage))
"""


def test_a_process_that_imported_src_exits_with_its_objects_frozen():
    result = run_process([sys.executable, "-c", EXITING])
    assert (result.returncode, result.stdout) == (0, "True\n"), result.stderr
