"""Records of the s3 tier on ``file://``: regular files in real shard folders, never through a link.

Anyone who can write a shared folder could put a FIFO under a record's name (opening it
waits for a writer for ever: a pool thread lost per read, and the process could not exit),
or replace a shard folder by a link, so that records are written, read and removed in
another folder. Every operation here opens the shard folder without following a link and
works relative to it; the record itself is opened without following a link either, and
read only when it is a regular file. The store's own folder (the URL's path) may be a link:
that is the operator's choice.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from kvplug.errors import CorruptChunkError
from kvplug_s3.reads import over_bound

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


@contextmanager
def shard_folder(path: str, *, create: bool = False) -> Iterator[int]:
    """A descriptor of the shard folder of the record at ``path`` (``<root>/<shard>/<name>``),
    opened without following a link; ``create`` makes the root and the shard when missing.
    A link or anything but a folder there raises :class:`NotADirectoryError`."""
    root, shard, _ = path.rsplit("/", 2)
    if create:
        os.makedirs(root, exist_ok=True)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        if create:
            try:
                os.mkdir(shard, dir_fd=root_fd)
            except FileExistsError:
                pass
        try:
            shard_fd = os.open(shard, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=root_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise NotADirectoryError(f"{root}/{shard} is not a folder of this store (a link or a file)") from None
            raise
    finally:
        os.close(root_fd)
    try:
        yield shard_fd
    finally:
        os.close(shard_fd)


def read_local_file(path: str, bound: int | None) -> bytes | CorruptChunkError:
    """The record file at ``path``, at most ``bound + 1`` bytes of it; anything but a regular
    file (a FIFO, a link, a device) is corrupt, and so is a shard that is no folder of the store."""
    name = path.rsplit("/", 1)[1]
    try:
        with shard_folder(path) as shard_fd:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=shard_fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    return CorruptChunkError("a link, not a record file")
                raise
    except NotADirectoryError as exc:
        return CorruptChunkError(str(exc))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return CorruptChunkError("not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read() if bound is None else file.read(bound + 1)
    finally:
        os.close(fd)
    if bound is not None and len(data) > bound:
        return over_bound(bound)
    return data


def write_local_file(path: str, data: bytes) -> None:
    """Store ``data`` as the record file at ``path``: written to a temporary in the same
    (real) shard folder and renamed into place, so a reader or a crash never leaves a
    partial record under the final name."""
    name = path.rsplit("/", 1)[1]
    # A leading dot and a suffix keep temporaries out of listings (not a digest name).
    temporary = f".{name}.tmp-{uuid.uuid4().hex}"
    with shard_folder(path, create=True) as shard_fd:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666, dir_fd=shard_fd)
        try:
            with os.fdopen(fd, "wb", closefd=False) as file:
                file.write(data)
            os.close(fd)
            fd = -1
            os.rename(temporary, name, src_dir_fd=shard_fd, dst_dir_fd=shard_fd)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(temporary, dir_fd=shard_fd)
            except OSError:
                pass
            raise


def remove_local_file(path: str) -> None:
    """Remove the record file at ``path`` (a link or FIFO there too, never a link's target);
    ``FileNotFoundError`` when none is there, or its shard is no folder of the store."""
    name = path.rsplit("/", 1)[1]
    try:
        with shard_folder(path) as shard_fd:
            os.unlink(name, dir_fd=shard_fd)
    except NotADirectoryError:
        raise FileNotFoundError(path) from None
