"""What a cache is built from, read once and verified (:mod:`src.data.nifti.snapshot`), on real files: a volume whose
compressed stream is damaged past its header, cut short or longer than its header says is refused; the labels CSV is
read once, so one deleted or rewritten while the cache builds changes nothing; a volume changed after the cache's key
was taken, or while it is read, refuses the build: never a cache of mixed content.

A change "while the cache builds" is made from a hook on a real step of the build (the header reads, the volumes'
reads), so it lands at a known point, not after a sleep."""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from src.data.files import check_file, npz_path
from src.data.loaders import load_splits
from src.data.nifti import cache, snapshot
from src.data.nifti.cache import ensure, read_meta
from tests.data.helpers import refusal
from tests.data.nifti.folders import CSV, nifti, noise, save, six, spoil_gzip, write_csv


def no_cache(root) -> bool:
    """No cache of the folder ``root`` under any key, and no partial file of one."""
    folder = Path(os.environ["MEDSWEEP_CACHE_DIR"], "volumes")
    return not folder.exists() or not [path for path in folder.iterdir() if f"nifti_{root.name}_" in path.name]


@pytest.mark.parametrize("how", ["crc", "isize", "voxels-under-the-old-trailer", "trailing-garbage"])
def test_a_volume_whose_gzip_stream_is_damaged_past_its_header_is_refused_and_no_cache_written(tmp_path, how):
    """nibabel reads the header and the voxels it needs and stops: the damage was trained on, exit 0."""
    six(tmp_path)
    spoil_gzip(tmp_path / "b1.nii.gz", how)
    cfg = nifti(tmp_path, "data.size=16")
    assert not check_file(cfg)  # a dry run reads headers only
    detail = {
        "crc": "CRC check failed",
        "isize": "Incorrect length of data produced",
        "voxels-under-the-old-trailer": "CRC check failed",
        "trailing-garbage": "Not a gzipped file",
    }[how]
    line = refusal(ensure, cfg)
    assert line.startswith(f"{tmp_path / CSV} line 5: {tmp_path / 'b1.nii.gz'} is damaged (gzip: {detail}"), line
    assert line.endswith("): replace it with an intact copy, or drop the row")
    assert no_cache(tmp_path)


def test_a_gzip_stream_of_several_members_reads_as_one(tmp_path):
    """gzip's own format: members one after another, each with its CRC (``cat a.gz b.gz``), trailing zeros ignored."""
    six(tmp_path)
    cfg = nifti(tmp_path, "data.size=16")
    whole = load_splits(cfg)["val"][0]
    path = tmp_path / "b1.nii.gz"
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(data[:1000]) + gzip.compress(data[1000:]) + b"\0" * 8)
    assert (load_splits(cfg)["val"][0] == whole).all()


def test_a_header_that_implies_more_voxels_than_the_stream_holds_is_refused_before_they_are_allocated(tmp_path):
    """30000^3 voxels, 108 TB as float32, in a 2 kB file: resampled to 100 mm they pass the size guard; reading
    them was a MemoryError (or, smaller, the machine's memory filled)."""
    six(tmp_path)
    path = tmp_path / "b1.nii.gz"
    raw = bytearray(gzip.decompress(path.read_bytes()))
    raw[42:48] = np.array([30000] * 3, "<i2").tobytes()  # dim[1..3]
    path.write_bytes(gzip.compress(bytes(raw)))
    cfg = nifti(tmp_path, "data.size=16", "data.spacing=[100,100,100]")
    assert not check_file(cfg)
    assert refusal(ensure, cfg) == (
        f"{tmp_path / CSV} line 5: {path} is cut short: its header implies {352 + 4 * 30000**3} bytes, the file "
        f"holds {len(raw)} once decompressed: replace it, or drop the row"
    )


def test_a_volume_that_decompresses_to_far_more_than_its_header_says_is_refused(tmp_path):
    """Its voxels are the header's, the rest not (a decompression bomb reads no further than twice the header's)."""
    six(tmp_path)
    path = tmp_path / "b1.nii.gz"
    data = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(data + bytes(10 * len(data))))
    line = refusal(ensure, nifti(tmp_path, "data.size=16"))
    assert line == (
        f"{tmp_path / CSV} line 5: {path} holds more than twice the {len(data)} bytes its header implies once "
        f"decompressed: replace it, or drop the row"
    )


def in_the_build(monkeypatch, step: str, change, when: int = 1) -> None:
    """``change()`` run once, just before the ``when``-th call of the build's ``step`` (``read_header``: the headers,
    read after the cache's key; ``cubes``: the voxels, read after every header)."""
    real, calls = getattr(cache, step), []

    def hooked(*args, **kwargs):
        calls.append(step)
        if len(calls) == when:
            change()
        return real(*args, **kwargs)

    monkeypatch.setattr(cache, step, hooked)


def rewrite(path) -> None:
    save(path, noise(99))


def replace_keeping_size_and_time(path) -> None:
    """Another volume of the same size put in its place, its time set back (``rsync -t``, ``cp -p`` of a copy): the
    cache's key, the size and time, stays; the file's inode and change time do not."""
    stat = path.stat()
    fresh = path.with_name("fresh.nii")
    save(fresh, noise(99))
    assert fresh.stat().st_size == stat.st_size
    os.utime(fresh, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(fresh, path)


def uncompressed(root) -> None:
    """:func:`six`'s volumes as ``.nii`` (each the same size)."""
    rows = [line.split(",") for line in (root / CSV).read_text().split()[1:]]
    for seed, (image, _, _) in enumerate(rows):
        save(root / image.removesuffix(".gz"), noise(seed))
        (root / image).unlink()
    write_csv(root, [[image.removesuffix(".gz"), label, split] for image, label, split in rows])


@pytest.mark.parametrize(
    "change",
    ["rewritten", "replaced-keeping-size-and-time", "deleted", "made-a-folder"],
)
def test_a_volume_changed_after_the_caches_key_was_taken_refuses_the_build(tmp_path, monkeypatch, change):
    """The key (each file's size and time) names the cache: voxels read from a file changed since would be cached
    under the old content's name."""
    six(tmp_path)
    uncompressed(tmp_path)
    path = tmp_path / "a0.nii"
    act = {
        "rewritten": lambda: rewrite(path),
        "replaced-keeping-size-and-time": lambda: replace_keeping_size_and_time(path),
        "deleted": path.unlink,
        "made-a-folder": lambda: (path.unlink(), path.mkdir()),
    }[change]
    in_the_build(monkeypatch, "read_header", act, when=6)  # the last header read; a0's voxels not yet
    cfg = nifti(tmp_path, "data.size=16")
    line = refusal(ensure, cfg)
    assert line.startswith(f"{tmp_path / CSV} line 2: {path} changed while the cache was built ("), line
    assert line.endswith(f"): run again once nothing writes to data.root={tmp_path}")
    assert no_cache(tmp_path)


def test_a_volume_changed_while_it_is_read_refuses_the_build(tmp_path, monkeypatch):
    """Its bytes are read once, in pieces: a write between two of them (here after gzip's magic number, its trailer
    overwritten in place, the time put back) shows in the file's stat after the last."""
    six(tmp_path)
    path = tmp_path / "b1.nii.gz"
    real, read = snapshot.Hashed.read, []

    def read_then_rewrite(self, size=-1):
        chunk = real(self, size)
        if self.name == str(path) and not read:
            read.append(len(chunk))
            stat = path.stat()
            with open(path, "r+b") as f:  # a writer in place, same length, same time: only ctime tells
                f.seek(stat.st_size - 4)
                f.write(b"\0\0\0\0")
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        return chunk

    monkeypatch.setattr(snapshot.Hashed, "read", read_then_rewrite)
    cfg = nifti(tmp_path, "data.size=16")
    line = refusal(ensure, cfg)
    assert read and line.startswith(f"{tmp_path / CSV} line 5: {path} changed while the cache was built ("), line
    assert no_cache(tmp_path)


def test_a_labels_csv_deleted_or_rewritten_while_the_cache_builds_changes_nothing(tmp_path, monkeypatch):
    """The CSV is read once: the rows, the key and the digest are of the bytes read (a second read for the digest
    was a FileNotFoundError, or the digest of other rows)."""
    six(tmp_path)
    csv = tmp_path / CSV
    original = csv.read_bytes()
    cfg = nifti(tmp_path, "data.size=16")
    expected = read_meta(ensure(cfg))
    npz_path(cfg).unlink()
    in_the_build(monkeypatch, "cubes", csv.unlink)
    path = ensure(cfg)
    assert read_meta(path) == expected
    csv.write_bytes(original)
    path.unlink()
    in_the_build(monkeypatch, "cubes", lambda: csv.write_bytes(original.replace(b",", b" , ")))  # the same rows
    assert read_meta(ensure(cfg)) == expected


def test_the_digest_is_of_the_bytes_the_cubes_were_made_from(tmp_path):
    six(tmp_path)
    meta = read_meta(ensure(nifti(tmp_path, "data.size=16")))
    digest = hashlib.md5((tmp_path / CSV).read_bytes())
    for image in ("a0", "b0", "a1", "b1", "a2", "b2"):
        digest.update(hashlib.md5((tmp_path / f"{image}.nii.gz").read_bytes()).hexdigest().encode())
    assert meta["digest"] == digest.hexdigest()


def test_a_volume_linked_from_inside_the_folder_is_read_through_its_link(tmp_path):
    """A link is the user's: its target may be anywhere (a shared store); its stat is the target's."""
    six(tmp_path / "d")
    shutil.move(tmp_path / "d" / "a0.nii.gz", tmp_path / "elsewhere.nii.gz")
    os.symlink(tmp_path / "elsewhere.nii.gz", tmp_path / "d" / "a0.nii.gz")
    assert load_splits(nifti(tmp_path / "d", "data.size=16"))["train"][0].shape == (2, 1, 16, 16, 16)


def test_a_labels_csv_changed_while_it_is_read_is_one_line(tmp_path, monkeypatch):
    """Its rows would be half the old file's, half the new's."""
    six(tmp_path)
    csv = tmp_path / CSV
    size, real, appended = csv.stat().st_size, snapshot.Hashed.read, []

    def read_then_append(self, size=-1):
        chunk = real(self, size)
        if self.name == str(csv) and not appended:
            with csv.open("a") as f:
                appended.append(f.write("c0.nii.gz,a,train\n"))
        return chunk

    monkeypatch.setattr(snapshot.Hashed, "read", read_then_append)
    assert refusal(ensure, nifti(tmp_path, "data.size=16")) == (
        f"{csv} changed while it was read ({size} bytes, then {size + appended[0]}): run again once nothing writes "
        "to it"
    )
