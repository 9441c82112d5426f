"""What a NIfTI folder's cache is built from, each file read once, whole, and checked unchanged while it was used.

A file's :class:`Stamp` (size, modification and change times, device and inode) is taken before the cache's key is
(the key holds each volume's size and time); :func:`read` takes its bytes in one pass, the MD5 of the file's own bytes
alongside, and compares the stamp of the open file and of the path with it after the last byte: a file written,
replaced (``rsync -t`` keeps the size and time; not the inode and change time), deleted or made a folder in between
raises :class:`Changed`, so no cache holds voxels its name does not say. A compressed file (``.gz``, ``.bz2``, as
nibabel names them) is decompressed to the end of its stream, so gzip's CRC-32 and length, and bz2's CRC, are checked:
nibabel reads no further than the voxels it needs, and a damaged stream was trained on. A write that lands within the
file system's timestamp granularity of the file's last one, keeping its size, inode and times, is not seen.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import io
import os
import stat
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

CHUNK = 2**20  # bytes per read
COMPRESSED: dict[str, tuple[str, Callable[[Any], BinaryIO]]] = {  # nibabel's suffixes (Opener.compress_ext_map)
    ".gz": ("gzip", lambda file: gzip.GzipFile(fileobj=file, mode="rb")),
    ".bz2": ("bzip2", lambda file: bz2.BZ2File(file, "rb")),
}


class Changed(Exception):
    """The file is not what its stamp said (the message says what differs)."""


class Damaged(Exception):
    """A compressed stream that does not decompress whole (the message: the format and its decoder's first line)."""


class NotAFile(Exception):
    """A folder, FIFO or device where a file was expected."""


@dataclass(frozen=True)
class Stamp:
    size: int
    mtime_ns: int
    ctime_ns: int  # set by the kernel at any write, rename in place or utime: what rsync -t cannot put back
    inode: tuple[int, int]  # (device, inode)
    regular: bool

    @classmethod
    def of(cls, result: os.stat_result) -> Stamp:
        return cls(
            result.st_size,
            result.st_mtime_ns,
            result.st_ctime_ns,
            (result.st_dev, result.st_ino),
            stat.S_ISREG(result.st_mode),
        )

    def differs(self, now: Stamp) -> str | None:
        """What differs in ``now``, for a message; None when nothing does."""
        if now.inode != self.inode or now.regular != self.regular:
            return "another file in its place"
        if now.size != self.size:
            return f"{self.size} bytes, then {now.size}"
        if now.mtime_ns != self.mtime_ns:
            return "written to"
        if now.ctime_ns != self.ctime_ns:
            return "its change time moved: written to with its time set back, or its mode or owner changed"
        return None


def stamp(path: Path) -> Stamp:
    """``path``'s stamp, through links (a link's target is the volume); raises OSError."""
    return Stamp.of(os.stat(path))


def compression(path: Path) -> str | None:
    """The suffix that makes nibabel decompress ``path`` (case ignored, as nibabel does), or None."""
    suffix = path.suffix.lower()
    return suffix if suffix in COMPRESSED else None


class Hashed:
    """A file read through: the MD5 of every byte read."""

    mode = "rb"

    def __init__(self, file: BinaryIO, name: str) -> None:
        self.file, self.name, self.md5 = file, name, hashlib.md5()

    def read(self, size: int = -1) -> bytes:
        chunk = self.file.read(size)
        self.md5.update(chunk)
        return chunk


@dataclass(frozen=True)
class Snapshot:
    data: io.BytesIO  # the bytes read (decompressed where asked), at most the limit and one more, at position 0
    size: int  # how many
    md5: str  # of the file's own bytes (compressed, where it is)
    stamp: Stamp


def read(path: Path, limit: int, before: Stamp | None = None, decompress: bool = False) -> Snapshot:
    """``path``'s bytes, decompressed by its suffix when ``decompress``, read to their end or to ``limit`` bytes and
    one more (a size the caller refuses: a decompression bomb reads no further), checked unchanged since ``before``
    (else since it was opened) after the last byte. Raises :class:`Changed`, :class:`Damaged`, :class:`NotAFile`,
    OSError (``before`` given: a file gone is :class:`Changed`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens without a writer, then refused
    except FileNotFoundError:
        if before is None:
            raise
        raise Changed("deleted") from None
    with open_file(path, fd, before) as (file, opened):
        before = before or opened
        hashed, kind = Hashed(file, os.fspath(path)), compression(path) if decompress else None
        try:
            data, size = at_most(COMPRESSED[kind][1](hashed) if kind else hashed, limit + 1)
        except (OSError, EOFError, zlib.error) as err:  # a decoder's error; an OSError with an errno is the disk's
            unchanged(path, before, Stamp.of(os.fstat(fd)))  # a failed read of a changed file is the change
            if not kind or (isinstance(err, OSError) and err.errno is not None):
                raise
            detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise Damaged(f"{COMPRESSED[kind][0]}: {detail}") from None
        unchanged(path, before, Stamp.of(os.fstat(fd)))
    return Snapshot(data, size, hashed.md5.hexdigest(), before)


@contextlib.contextmanager
def open_file(path: Path, fd: int, before: Stamp | None) -> Iterator[tuple[BinaryIO, Stamp]]:
    """The file open on ``fd`` (closed after) and its stamp, which must be ``before``'s: a regular file."""
    try:
        opened = Stamp.of(os.fstat(fd))
        if before is not None:
            unchanged(path, before, opened)
        elif not opened.regular:
            raise NotAFile(path)
        file = open(fd, "rb", buffering=0)  # noqa: SIM115 (it owns fd from here)
    except BaseException:
        os.close(fd)
        raise
    with file:
        yield file, opened


def unchanged(path: Path, before: Stamp, opened: Stamp) -> None:
    """Raises :class:`Changed` unless the open file's stamp and the path's are ``before``."""
    try:
        now = stamp(path)
    except FileNotFoundError:
        raise Changed("deleted") from None
    what = before.differs(opened) or before.differs(now)
    if what:
        raise Changed(what)


def at_most(stream: Any, limit: int) -> tuple[io.BytesIO, int]:
    """``stream`` read to its end (a decoder checks its stream's CRC there) or to ``limit`` bytes, and how many."""
    data, size = io.BytesIO(), 0
    while size < limit:
        chunk = stream.read(min(CHUNK, limit - size))
        if not chunk:
            break
        size += data.write(chunk)
    data.seek(0)
    return data, size
