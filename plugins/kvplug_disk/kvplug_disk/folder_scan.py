"""Listing the record files of a disk tier's folder (:class:`FolderScan`, a base of
:class:`~kvplug_disk.files.RecordFolder`): every shard folder's entries, records told from
temp files and from foreign entries, stale temp files removed; and the names all of it reads.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG
from typing import TYPE_CHECKING

from kvplug_disk.tenant_tags import read_tag

RECORD_SUFFIX = ".kvr"
TEMP_SUFFIX = ".tmp"
SHARDS = tuple(f"{i:02x}" for i in range(256))


def _pid_namespace() -> str:
    """This process's PID namespace (``pid:[4026531836]``), ``""`` where that cannot be read."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


#: Tells this host's temp files from another host's on a shared (network) folder, where a
#: pid says nothing about whether the writer still runs; and from another PID namespace's
#: (containers with the host's name, pods on the host network), whose pids this one does not see.
HOST_TAG = hashlib.sha256(f"{socket.gethostname()}\0{_pid_namespace()}".encode()).hexdigest()[:8]
RECORD_NAME = re.compile(r"[0-9a-f]{64}\.kvr")


class ForeignEntryError(OSError):
    """A record's name holds something that is not a regular file (a folder, a link, a
    FIFO), or its shard folder is not a real folder: never read, written or followed.
    ``filename`` is the entry: a record's digest, or a shard's two hex digits."""


@dataclass
class ScanResult:
    """Record files as ``(digest, file size, mtime ns)`` tuples (plain tuples: start-up
    builds 100k of them), and what happened to temp files."""

    records: list[tuple[str, int, int]]
    temps_removed: int
    temps_kept: int
    #: ``<shard>/<name>`` of entries that are not regular files, and shard names that are not folders.
    foreign: list[str] = field(default_factory=list)
    #: The tenant tags of the records that carry one, by digest; ``None``: not read (``scan(tags=False)``).
    tags: dict[str, bytes] | None = None


class FolderScan:
    """The scanning methods of a record folder (its root, by path and by descriptor)."""

    root: Path
    _root_fd: int

    if TYPE_CHECKING:

        def _open_shard(self, shard: str, *, create: bool = False) -> int: ...

    def scan(self, *, clean_temps_older_than: float | None = None, tags: bool = False) -> ScanResult:
        """Every record file; stale temp files are removed when a limit is given; with ``tags``,
        each record's tenant tag too (:func:`~kvplug_disk.tenant_tags.read_tag`: read through the
        shard folder's descriptor the listing holds, not by walking the record's path again).
        Entries with a record's name that are not regular files, and shard folders that
        are not folders or that this user may not open or search, are listed in ``foreign`` instead."""
        result = ScanResult([], 0, 0, tags={} if tags else None)
        found_tags = result.tags
        now = time.time()
        is_record = RECORD_NAME.fullmatch
        unsearchable: set[str] = set()
        for shard, dir_fd, entry in self._shard_entries(result.foreign):
            name = entry.name
            if shard in unsearchable:
                continue
            try:
                if is_record(name):
                    if not name.startswith(shard):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # evicted by another process meanwhile
                        continue
                    if S_ISREG(st.st_mode):
                        result.records.append((name[:64], st.st_size, st.st_mtime_ns))
                        if found_tags is not None and (tag := read_tag(dir_fd, name)) is not None:
                            found_tags[name[:64]] = tag
                    else:
                        result.foreign.append(f"{shard}/{name}")
                elif name.endswith(TEMP_SUFFIX) and clean_temps_older_than is not None:
                    if _temp_is_stale(entry, now, clean_temps_older_than):
                        try:
                            os.unlink(f"{shard}/{name}", dir_fd=self._root_fd)
                            result.temps_removed += 1
                        except FileNotFoundError:
                            pass
                        except OSError:  # not ours to remove
                            result.temps_kept += 1
                    else:
                        result.temps_kept += 1
            except PermissionError:  # a shard folder listed but not searchable: left alone as a whole
                unsearchable.add(shard)
                result.foreign.append(shard)
        return result

    def iter_record_paths(self) -> Iterator[tuple[str, str]]:
        """``(digest, path)`` of every regular record file, without stat calls where
        the folder tells the type."""
        for shard, _, entry in self._shard_entries([]):
            if RECORD_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                yield entry.name[:64], f"{self.root}/{shard}/{entry.name}"

    def _shard_entries(self, foreign: list[str]) -> Iterator[tuple[str, int, os.DirEntry[str]]]:
        """``(shard, its folder's descriptor, entry)`` for everything in the shard folders that
        exist; shard names that are not real folders go to ``foreign``."""
        for shard in SHARDS:
            try:
                dir_fd = self._open_shard(shard)
            except FileNotFoundError:
                continue
            except ForeignEntryError:
                foreign.append(shard)
                continue
            try:
                with os.scandir(dir_fd) as entries:
                    for entry in entries:
                        yield shard, dir_fd, entry
            finally:
                os.close(dir_fd)


def _temp_is_stale(entry: os.DirEntry[str], now: float, max_age_s: float) -> bool:
    try:
        age = now - entry.stat(follow_symlinks=False).st_mtime
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
