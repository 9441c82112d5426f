"""``python -m src.volumes``, the inspect command of a NIfTI folder, in real processes: the cache built and described
(again when corrupt), another dataset refused, bad input refused in one line."""

from __future__ import annotations

import pytest

from src.data.files import npz_path
from src.data.nifti.cache import read_meta
from tests.data.nifti.folders import CSV, bad_cases, nifti, prepare, six, spoil_gzip
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
@pytest.mark.parametrize("case", ["zero-affine", "huge-index", "long-root", "no-val-class", "utf16-without-bom"])
def test_the_inspect_command_refuses_bad_input_in_one_line(tmp_path, case):
    prepare(tmp_path, case)
    overrides, start = bad_cases(tmp_path)[case]
    result = run_cli(
        "data=nifti", f"data.root={tmp_path}", "data.size=16", *overrides, module="src.volumes", timeout=300
    )
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {start}")


@pytest.mark.slow
def test_the_inspect_command_refuses_a_volume_damaged_past_its_header_and_reads_a_utf16_csv(tmp_path, cache_dir):
    """A bad CRC in a ``.nii.gz`` (nibabel reads its header and voxels without seeing it) is one line, exit 2, no
    cache; the same folder's CSV saved as a spreadsheet's "Unicode" (UTF-16 with its byte-order mark) reads."""
    six(tmp_path)
    spoil_gzip(tmp_path / "b1.nii.gz", "crc")
    args = ("data=nifti", f"data.root={tmp_path}", "data.size=16")
    result = run_cli(*args, module="src.volumes", timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {tmp_path / CSV} line 5: {tmp_path / 'b1.nii.gz'} is damaged (gzip: CRC check")
    assert not [path for path in (cache_dir / "volumes").glob(f"*nifti_{tmp_path.name}_*")]
    six(tmp_path)  # intact volumes again
    (tmp_path / CSV).write_bytes((tmp_path / CSV).read_text().encode("utf-16"))
    described = run_cli(*args, module="src.volumes", timeout=300)
    assert described.returncode == 0, described.stderr[-3000:]
    assert "classes   0 a: train 1, val 1, test 1 | 1 b: train 1, val 1, test 1" in described.stdout
