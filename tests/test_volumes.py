"""``python -m src.volumes``, the inspect command of a NIfTI folder, in real processes: the cache built and described
(again when corrupt), another dataset refused, bad input refused in one line."""

from __future__ import annotations

import pytest

from src.data.files import npz_path
from src.data.nifti.cache import read_meta
from tests.data.nifti.folders import CSV, bad_cases, nifti, prepare, six
from tests.helpers import run_cli


@pytest.mark.slow
def test_the_inspect_command_builds_and_describes_the_cache(tmp_path):
    six(tmp_path)
    result = run_cli("data=nifti", f"data.root={tmp_path}", "data.size=16", module="src.volumes", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    cfg = nifti(tmp_path, "data.size=16")
    path = npz_path(cfg)
    lines = result.stdout.strip().splitlines()
    assert lines[:4] == [
        f"volumes   {tmp_path} (labels {tmp_path / CSV})",
        "classes   0 a: train 1, val 1, test 1 | 1 b: train 1, val 1, test 1",
        "splits    train 2, val 2, test 2 (the CSV's split column)",
        "spacings  seen, mm along R x A x S: 1 x 1 x 1 (6 volumes)",
    ]
    assert (
        lines[4]
        == "          resampled to 1 x 1 x 1 mm (the training median), cropped or padded to 16^3, intensity minmax"
    )
    assert lines[5].startswith(f"cache     {path} (") and read_meta(path)["digest"] in lines[5]
    path.write_bytes(b"")  # a corrupt cache: built again, then described
    again = run_cli("data=nifti", f"data.root={tmp_path}", "data.size=16", module="src.volumes", timeout=300)
    assert again.returncode == 0 and again.stdout.strip().splitlines()[:5] == lines[:5], again.stderr[-3000:]
    not_nifti = run_cli("data=synthetic", module="src.volumes", timeout=300)
    assert not_nifti.returncode == 2
    assert not_nifti.stderr.strip().splitlines() == [
        "error: python -m src.volumes describes a NIfTI folder, not data=synthetic: add data=nifti"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zero-affine", "huge-index", "long-root"])
def test_the_inspect_command_refuses_bad_input_in_one_line(tmp_path, case):
    prepare(tmp_path, case)
    overrides, start = bad_cases(tmp_path)[case]
    result = run_cli(
        "data=nifti", f"data.root={tmp_path}", "data.size=16", *overrides, module="src.volumes", timeout=300
    )
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {start}")
