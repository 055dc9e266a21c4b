"""The files of tier ``disk``: where records live and how they are written safely.

Layout under the tier's folder::

    <ab>/<sha256(key) hex>.kvr                          one record: kvplug record frame + value
    <ab>/<digest>.<host>.<pid>.<tid>.<random>.tmp       a write in progress
    .kvplug-usage                                       the folder's shared byte total (kvplug_disk.ledger)
    .kvplug-store                                       says the folder is a store (kvplug_disk.location)

``<ab>`` is the first two hex digits of the digest: 256 shard folders, so a
folder holds ~400 files per 100k records and start-up lists 256 folders, not 65k.
A key never becomes part of a path; only its sha256 digest does.

A write goes to a temp file of a unique name in the record's own folder, is
fdatasync'ed, then renamed over the final name (atomic on POSIX), and the folder
is fsync'ed. A reader opens the final name only, so it sees a whole old record, a
whole new one, or nothing. A writer killed mid-write leaves only a temp file,
removed at the next start once it is provably stale (its process is gone, or it
is older than ``stale_temp_s``): another live process may still be writing it.

Nothing is followed out of the folder: shard folders are opened with ``O_NOFOLLOW``
relative to the root's descriptor, files relative to their shard's descriptor, and
an entry that is not what it should be (a link, a folder named like a record) raises
:class:`ForeignEntryError` for the tier to skip.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

from kvplug import RECORD_HEADER_SIZE, Buffer, check_record_size, key_digest
from kvplug.errors import CorruptChunkError
from kvplug_disk.folder_scan import HOST_TAG, RECORD_SUFFIX, SHARDS, TEMP_SUFFIX, FolderScan, ForeignEntryError
from kvplug_disk.tenant_tags import tag_file

#: Cached KV is a user's prompts: its folders and files are this user's alone (the umask
#: may only take more away).
PRIVATE_FOLDER = 0o700
PRIVATE_FILE = 0o600
_fdatasync = getattr(os, "fdatasync", os.fsync)
#: Bytes compared per read when checking that a file still holds a record read before.
_COMPARE_BLOCK = 1 << 20


def make_private(root_fd: int) -> int | None:
    """Make the store folder open as ``root_fd`` this user's alone when others may read,
    enter or write it and this user owns it; returns the mode it had (None: nothing done)."""
    found = os.fstat(root_fd)
    mode = stat.S_IMODE(found.st_mode)
    if not mode & 0o077 or found.st_uid != os.geteuid():
        return None
    os.fchmod(root_fd, PRIVATE_FOLDER)
    return mode


def digest_of(key: str) -> str:
    """The sha256 hex digest that names ``key``'s file."""
    if not isinstance(key, str):
        raise TypeError(f"tier keys are str, got {type(key).__name__}")
    return key_digest(key).hex()


def value_size_of(file_size: int) -> int:
    """Value bytes in a record file of ``file_size`` bytes (0 for a torn header)."""
    return max(0, file_size - RECORD_HEADER_SIZE)


@dataclass
class TempFile:
    """A written temp file, and the shard folder (by fd) it was written in: it is
    published into that very folder, whatever has happened to the path since."""

    name: str
    shard: str
    dir_fd: int
    #: Its tenant's tag (:mod:`kvplug_disk.tenant_tags`), where it was set on the file.
    tag: bytes | None = None


class RecordFolder(FolderScan):
    """The record files under one folder; every method is safe to call from many
    threads and processes at once.

    Every file operation goes through a descriptor of its shard folder, opened with
    ``O_NOFOLLOW`` relative to the root's descriptor, and record files are opened
    with ``O_NOFOLLOW`` too: a link planted in place of a shard or a record is never
    followed out of the store (it raises :class:`ForeignEntryError`). The root is
    the configured path, opened once; it may itself be a link the operator chose.
    """

    def __init__(self, root: Path, *, fsync: bool = True, create: bool = True) -> None:
        self.root = root
        self.fsync = fsync
        if create:
            root.mkdir(mode=PRIVATE_FOLDER, parents=True, exist_ok=True)
        self._root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        if create:
            for shard in SHARDS:
                with contextlib.suppress(FileExistsError):  # a link or file there is refused when used, not replaced
                    os.mkdir(shard, PRIVATE_FOLDER, dir_fd=self._root_fd)
            self.sync_dirs([])

    @property
    def root_fd(self) -> int:
        return self._root_fd

    def close(self) -> None:
        fd, self._root_fd = self._root_fd, -1
        if fd >= 0:
            os.close(fd)

    def path_of(self, digest: str) -> str:
        return f"{self.root}/{digest[:2]}/{digest}{RECORD_SUFFIX}"

    def shard_of(self, digest: str) -> str:
        return digest[:2]

    def _open_shard(self, shard: str, *, create: bool = False) -> int:
        """A descriptor of a real shard folder (never through a link)."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(shard, flags, dir_fd=self._root_fd)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):  # someone removed the shard folder: make it again
                os.mkdir(shard, PRIVATE_FOLDER, dir_fd=self._root_fd)
            return self._open_shard(shard)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ForeignEntryError(
                    exc.errno, f"shard folder {self.root}/{shard} is not a folder (a link?)", shard
                ) from None
            if exc.errno in (errno.EACCES, errno.EPERM):  # left alone like a link: the other shards serve
                raise ForeignEntryError(
                    exc.errno,
                    f"shard folder {self.root}/{shard} may not be opened by this user (another user's?)",
                    shard,
                ) from None
            raise

    # --- writing --------------------------------------------------------------------

    def write_temp(
        self, digest: str, header: bytes, value: Buffer, *, mtime_ns: int | None = None, tag: bytes | None = None
    ) -> TempFile:
        """Write a record (its ``header``, then ``value``) to a new temp file next to its
        final name, stamped ``mtime_ns`` (default: now), tagged with its tenant's ``tag``."""
        shard = self.shard_of(digest)
        name = f"{digest}.{HOST_TAG}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        dir_fd = self._open_shard(shard, create=True)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(name, flags, PRIVATE_FILE, dir_fd=dir_fd)
        except BaseException:
            os.close(dir_fd)
            raise
        temp = TempFile(name, shard, dir_fd)
        try:
            _write_all(fd, [header, value])
            if tag is not None and tag_file(fd, tag):
                temp.tag = tag
            # Explicit ns mtime: kernel timestamps are jiffy-coarse, and the LRU order
            # rebuilt at start comes from mtimes.
            stamp = time.time_ns() if mtime_ns is None else mtime_ns
            os.utime(fd, ns=(stamp, stamp))
            if self.fsync:
                _fdatasync(fd)
        except BaseException:
            os.close(fd)
            self.discard_temp(temp)
            raise
        os.close(fd)
        return temp

    def publish(self, temp: TempFile, digest: str) -> None:
        """Rename a written temp file over the record's final name, in its own folder.
        If that fails, the temp file is still there for :meth:`discard_temp`."""
        os.replace(temp.name, f"{digest}{RECORD_SUFFIX}", src_dir_fd=temp.dir_fd, dst_dir_fd=temp.dir_fd)
        os.close(temp.dir_fd)
        temp.dir_fd = -1

    def discard_temp(self, temp: TempFile) -> None:
        if temp.dir_fd < 0:
            return
        try:
            with contextlib.suppress(OSError):  # gone already; or not ours to remove: start-up cleans stale temps
                os.unlink(temp.name, dir_fd=temp.dir_fd)
        finally:
            os.close(temp.dir_fd)
            temp.dir_fd = -1

    def sync_dirs(self, shards: Iterable[str]) -> None:
        """fsync shard folders (and the root) so that renames and unlinks in them survive a power loss."""
        if not self.fsync:
            return
        os.fsync(self._root_fd)
        for shard in shards:
            try:
                fd = self._open_shard(shard)
            except OSError:  # gone, or a link: nothing of ours to sync there
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def unlink(self, digest: str) -> bool:
        """Remove a record file; ``False`` if it was not there. Raises ``OSError``
        (``PermissionError``, ``IsADirectoryError``, ...) for an entry that cannot be removed."""
        dir_fd = self._open_shard(self.shard_of(digest))
        try:
            os.unlink(f"{digest}{RECORD_SUFFIX}", dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        finally:
            os.close(dir_fd)
        return True

    def unlink_if_same(self, digest: str, stat: os.stat_result) -> bool:
        """Remove a record file only if it is still the inode ``stat`` describes: a bad
        file must not take a good one, renamed over it meanwhile, down with it."""
        now = self.stat(digest)
        if now is None or (now.st_ino, now.st_dev) != (stat.st_ino, stat.st_dev):
            return False
        return self.unlink(digest)

    def holds(self, digest: str, seen: Buffer | None, max_bytes: int | None = None) -> bool:
        """Whether the record file is still what was read of it: the bytes ``seen``, or
        (``None``) a file whose size its header or ``max_bytes`` rules out. Compared a block at
        a time: nothing of the record's size is allocated."""
        opened = self.open_record(digest)
        if opened is None:
            return False
        fd, found = opened
        try:
            header = os.pread(fd, RECORD_HEADER_SIZE, 0)
            if seen is None:
                try:
                    check_record_size(header, found.st_size, max_bytes)
                except CorruptChunkError:
                    return True
                return False
            view = memoryview(seen).cast("B")
            if view.nbytes != found.st_size:
                return False
            position = 0
            while position < view.nbytes:
                block = os.pread(fd, min(_COMPARE_BLOCK, view.nbytes - position), position)
                if not block or block != view[position : position + len(block)]:
                    return False
                position += len(block)
            return True
        finally:
            os.close(fd)

    # --- reading --------------------------------------------------------------------

    def read(
        self, digest: str, *, max_bytes: int | None = None, mapped: bool = False
    ) -> tuple[Buffer, os.stat_result] | None:
        """The whole file and its stat, or ``None`` when there is no such file.

        Its header is read first: a file whose size is not the length the header
        declares, or is over ``max_bytes``, raises ``CorruptChunkError``
        (:func:`kvplug.check_record_size`) before more is read. ``mapped``: a view of a
        read-only mapping instead of a copy (nothing of the file's size is allocated;
        for inspection, whose reader drops it soon)."""
        opened = self.open_record(digest)
        if opened is None:
            return None
        fd, stat = opened
        size = stat.st_size
        try:
            check_record_size(os.pread(fd, RECORD_HEADER_SIZE, 0), size, max_bytes)
            if mapped and size:
                return memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)), stat
            data = os.read(fd, size)  # one allocation, no zero-fill
            while len(data) < size:  # short reads happen on some file systems
                more = os.read(fd, size - len(data))
                if not more:
                    break
                data += more
            return data, stat
        finally:
            os.close(fd)

    def open_record(self, digest: str) -> tuple[int, os.stat_result] | None:
        """A read-only descriptor of the record file (the caller closes it) and its
        stat, or ``None`` when there is no such file.

        Raises :class:`ForeignEntryError` for anything but a regular file (opened
        non-blocking, so a FIFO planted there cannot hang the reader)."""
        try:
            dir_fd = self._open_shard(self.shard_of(digest))
        except FileNotFoundError:
            return None
        try:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(f"{digest}{RECORD_SUFFIX}", flags, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ForeignEntryError(exc.errno, f"{self.path_of(digest)} is a link", digest) from None
            raise
        finally:
            os.close(dir_fd)
        try:
            return fd, self._regular(digest, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise

    def stat(self, digest: str) -> os.stat_result | None:
        """The record file's stat (never through a link), ``None`` if absent; raises
        :class:`ForeignEntryError` when something else than a regular file is there."""
        try:
            dir_fd = self._open_shard(self.shard_of(digest))
        except FileNotFoundError:
            return None
        try:
            stat = os.stat(f"{digest}{RECORD_SUFFIX}", dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        finally:
            os.close(dir_fd)
        return self._regular(digest, stat)

    def _regular(self, digest: str, found: os.stat_result) -> os.stat_result:
        """``found``, the stat of the record file ``digest``, if it is a regular file."""
        if not S_ISREG(found.st_mode):
            raise ForeignEntryError(errno.EISDIR, f"{self.path_of(digest)} is not a regular file", digest)
        return found

    def touch(self, digest: str) -> None:
        """Mark a record as just used, so the LRU order survives a restart."""
        now = time.time_ns()
        try:
            dir_fd = self._open_shard(self.shard_of(digest))
        except OSError:
            return
        try:
            with contextlib.suppress(OSError):  # evicted or read-only: the order is a hint, not data
                os.utime(f"{digest}{RECORD_SUFFIX}", ns=(now, now), dir_fd=dir_fd, follow_symlinks=False)
        finally:
            os.close(dir_fd)


def _write_all(fd: int, buffers: list[Buffer]) -> None:
    views = [memoryview(b) for b in buffers if memoryview(b).nbytes]
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]
