"""src/atomic.py: a write killed outright (SIGKILL) leaves its temp file, which the next write of that file removes
(a live writer's is kept); a stop signal's handler waits for an uninterrupted write: real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from src.atomic import atomic_path, is_temporary, remove_stale, uninterrupted, when_uninterrupted
from tests.helpers import ROOT

WRITER = """
import sys, time
from pathlib import Path
from src.atomic import atomic_path
with atomic_path(Path(sys.argv[1])) as partial:
    partial.write_bytes(b"half")
    print(partial.name, flush=True)
    time.sleep(600)
"""


@pytest.fixture
def writer() -> Iterator:
    """``writer(path)``: a process in the middle of an atomic write of ``path`` (its temp file written, not renamed),
    once it says so; whatever is left of them is killed at the end."""
    started: list[subprocess.Popen] = []

    def start(path: Path) -> tuple[subprocess.Popen, Path]:
        process = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        started.append(process)
        return process, path.with_name(process.stdout.readline().strip())

    yield start
    for process in started:
        process.kill()
        process.wait()


def test_a_write_killed_outright_leaves_a_temp_file_that_the_next_write_of_the_file_removes(tmp_path, writer):
    """SIGKILL mid-write left a checkpoint's temp file (263 MB) in the run folder for good."""
    path = tmp_path / "state.json"
    path.write_text("old")
    alive, writing = writer(path)
    killed, left = writer(path)
    killed.kill()
    killed.wait()
    assert writing.is_file() and left.is_file() and is_temporary(left)
    assert path.read_text() == "old"  # whole

    with atomic_path(path) as partial:
        partial.write_text("new")
    assert path.read_text() == "new"
    assert not left.exists()  # its writer is gone
    assert writing.is_file()  # its writer lives: its write is under way
    alive.kill()
    alive.wait()
    assert remove_stale(tmp_path) == [writing]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_handler_that_would_interrupt_an_uninterrupted_block_runs_at_its_end():
    done = []

    def interrupt() -> None:
        raise KeyboardInterrupt

    def stop(signum, frame):
        when_uninterrupted(interrupt)

    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        with pytest.raises(KeyboardInterrupt), uninterrupted("the checkpoint"):
            os.kill(os.getpid(), signal.SIGUSR1)
            done.append("written")  # the handler ran before this line, and raised nothing
        assert done == ["written"]
        with uninterrupted("the checkpoint"):
            pass  # nothing left over from the block before
    finally:
        signal.signal(signal.SIGUSR1, previous)
