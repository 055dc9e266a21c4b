"""The files of tier ``disk``: where records live and how they are written safely.

Layout under the tier's folder::

    <ab>/<sha256(key) hex>.kvr                          one record: kvplug.core.record frame + value
    <ab>/<digest>.<host>.<pid>.<tid>.<random>.tmp       a write in progress

``<ab>`` is the first two hex digits of the digest: 256 shard folders, so a
folder holds ~400 files per 100k records and start-up lists 256 folders, not 65k.
A key never becomes part of a path; only its sha256 digest does.

A write goes to a temp file of a unique name in the record's own folder, is
fdatasync'ed, then renamed over the final name (atomic on POSIX), and the folder
is fsync'ed. A reader opens the final name only, so it sees a whole old record, a
whole new one, or nothing. A writer killed mid-write leaves only a temp file,
removed at the next start once it is provably stale (its process is gone, or it
is older than ``stale_temp_s``): another live process may still be writing it.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvplug.core.record import RECORD_HEADER_SIZE, pack_record_header
from kvplug.core.tier import Buffer

RECORD_SUFFIX = ".kvr"
TEMP_SUFFIX = ".tmp"
SHARDS = tuple(f"{i:02x}" for i in range(256))
#: Tells this host's temp files from another host's on a shared (network) folder,
#: where a pid says nothing about whether the writer still runs.
HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_RECORD_NAME = re.compile(r"[0-9a-f]{64}\.kvr")
_fdatasync = getattr(os, "fdatasync", os.fsync)


def digest_of(key: str) -> str:
    """The sha256 hex digest that names ``key``'s file."""
    if not isinstance(key, str):
        raise TypeError(f"tier keys are str, got {type(key).__name__}")
    return hashlib.sha256(key.encode()).hexdigest()


def value_size_of(file_size: int) -> int:
    """Value bytes in a record file of ``file_size`` bytes (0 for a torn header)."""
    return max(0, file_size - RECORD_HEADER_SIZE)


@dataclass
class ScanResult:
    """Record files as ``(digest, file size, mtime ns)`` tuples (plain tuples: start-up
    builds 100k of them), and what happened to temp files."""

    records: list[tuple[str, int, int]]
    temps_removed: int
    temps_kept: int


class RecordFolder:
    """The record files under one folder; every method is safe to call from many
    threads and processes at once."""

    def __init__(self, root: Path, *, fsync: bool = True, create: bool = True) -> None:
        self.root = root
        self.fsync = fsync
        if create:
            root.mkdir(parents=True, exist_ok=True)
            for shard in SHARDS:
                (root / shard).mkdir(exist_ok=True)
            self.sync_dirs([str(root)])

    def path_of(self, digest: str) -> str:
        return f"{self.root}/{digest[:2]}/{digest}{RECORD_SUFFIX}"

    def shard_of(self, digest: str) -> str:
        return f"{self.root}/{digest[:2]}"

    # --- writing --------------------------------------------------------------------

    def write_temp(self, key: str, digest: str, value: Buffer) -> str:
        """Write ``value``'s record to a new temp file next to its final name; its path."""
        temp = f"{self.shard_of(digest)}/{digest}.{HOST_TAG}.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:  # someone removed the shard folder: make it again
            os.makedirs(self.shard_of(digest), exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            _write_all(fd, [pack_record_header(key, value), memoryview(value).cast("B")])
            # Explicit ns mtime: kernel timestamps are jiffy-coarse, and the LRU order
            # rebuilt at start comes from mtimes.
            now = time.time_ns()
            os.utime(fd, ns=(now, now))
            if self.fsync:
                _fdatasync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(temp)
            raise
        os.close(fd)
        return temp

    def publish(self, temp: str, digest: str) -> None:
        """Rename a written temp file over the record's final name."""
        os.replace(temp, self.path_of(digest))

    def discard_temp(self, temp: str) -> None:
        _unlink_quietly(temp)

    def sync_dirs(self, dirs: Iterable[str]) -> None:
        """fsync folders so that renames and unlinks in them survive a power loss."""
        if not self.fsync:
            return
        for directory in dirs:
            try:
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def unlink(self, digest: str) -> bool:
        """Remove a record file; ``False`` if it was not there."""
        return _unlink_quietly(self.path_of(digest))

    def unlink_if_same(self, digest: str, stat: os.stat_result) -> bool:
        """Remove a record file only if it is still the inode ``stat`` describes: a bad
        file must not take a good one, renamed over it meanwhile, down with it."""
        path = self.path_of(digest)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            return False
        if (now.st_ino, now.st_dev) != (stat.st_ino, stat.st_dev):
            return False
        return _unlink_quietly(path)

    # --- reading --------------------------------------------------------------------

    def read(self, digest: str) -> tuple[bytes, os.stat_result] | None:
        """The whole file and its stat, or ``None`` when there is no such file."""
        try:
            fd = os.open(self.path_of(digest), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            stat = os.fstat(fd)
            data = os.read(fd, stat.st_size)  # one allocation, no zero-fill
            while len(data) < stat.st_size:  # short reads happen on some file systems
                more = os.read(fd, stat.st_size - len(data))
                if not more:
                    break
                data += more
            return data, stat
        finally:
            os.close(fd)

    def stat(self, digest: str) -> os.stat_result | None:
        try:
            return os.stat(self.path_of(digest))
        except FileNotFoundError:
            return None

    def touch(self, digest: str) -> None:
        """Mark a record as just used, so the LRU order survives a restart."""
        now = time.time_ns()
        try:
            os.utime(self.path_of(digest), ns=(now, now))
        except OSError:  # evicted or read-only: the order is a hint, not data
            pass

    # --- scanning -------------------------------------------------------------------

    def scan(self, *, clean_temps_older_than: float | None = None) -> ScanResult:
        """Every record file; stale temp files are removed when a limit is given."""
        records: list[tuple[str, int, int]] = []
        removed = kept = 0
        now = time.time()
        is_record = _RECORD_NAME.fullmatch
        for shard, entry in self._shard_entries():
            name = entry.name
            if is_record(name):
                if not name.startswith(shard):
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:  # evicted by another process meanwhile
                    continue
                records.append((name[:64], st.st_size, st.st_mtime_ns))
            elif name.endswith(TEMP_SUFFIX) and clean_temps_older_than is not None:
                if _temp_is_stale(entry, now, clean_temps_older_than):
                    removed += _unlink_quietly(entry.path)
                else:
                    kept += 1
        return ScanResult(records, removed, kept)

    def iter_record_paths(self) -> Iterator[tuple[str, str]]:
        """``(digest, path)`` of every record file, without stat calls."""
        for _, entry in self._shard_entries():
            if _RECORD_NAME.fullmatch(entry.name):
                yield entry.name[:64], entry.path

    def _shard_entries(self) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """``(shard, entry)`` for everything in the shard folders that exist."""
        for shard in SHARDS:
            try:
                entries = os.scandir(f"{self.root}/{shard}")
            except FileNotFoundError:
                continue
            with entries:
                for entry in entries:
                    yield shard, entry


def _temp_is_stale(entry: os.DirEntry[str], now: float, max_age_s: float) -> bool:
    try:
        age = now - entry.stat().st_mtime
    except FileNotFoundError:
        return False
    if age > max_age_s:
        return True
    parts = entry.name.split(".")
    if len(parts) != 6 or parts[1] != HOST_TAG or not parts[2].isdigit():
        return False  # another host's (or an unknown) temp file: only age can tell
    return not _pid_alive(int(parts[2]))


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def _write_all(fd: int, buffers: list[Buffer]) -> None:
    views = [memoryview(b) for b in buffers if memoryview(b).nbytes]
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]


def _unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
