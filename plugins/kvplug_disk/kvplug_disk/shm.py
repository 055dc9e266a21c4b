"""Tier ``shm``: the disk tier's folder in shared memory (tmpfs), read by mapping records.

Several engine processes on one host that name the same folder (``/dev/shm/kvplug`` by
default) share one cache at memory speed, with no daemon: the folder is the store. All
of the disk tier's machinery is reused as it is (:class:`~kvplug_disk.tier.DiskTier`,
:class:`~kvplug_disk.backend.DiskBackend`): one record file per key, written to a temp
file and renamed into place (a killed writer leaves a temp file, never a torn record;
stale temps are removed at start), one byte budget for the folder across processes
(:mod:`kvplug_disk.ledger`), ``eviction: lru|s3fifo``, a ``stat`` per key for lookups.
Two things differ:

- Nothing is fsynced (``fsync`` is always off): tmpfs has no disk behind it, and the
  rename alone is what makes a record whole or absent.
- A read maps the record file read-only (``mmap``) and returns a
  memoryview over the mapping, not a copy: the record base verifies the record's
  checksum over the mapping (:func:`kvplug.unpack_record` returns a view, no copy) and
  the connector scatters from the same pages into the engine's KV cache. With
  ``trust_host`` the value's checksum is skipped (header, key and length are still
  checked): the operator vouches that only this user's engines write the folder.

Why a reader never sees the bytes of a mapped record change: the tier never writes a
record file in place. A record is written once, as a temp file, then renamed over the
final name, which points the name at a new inode; eviction and removal unlink the
name. A mapping holds its inode, so a reader keeps the old, whole bytes until it drops
the buffer (tmpfs frees the pages of an unlinked file when its last mapping goes). Only
a process that truncates or rewrites a record file in place (not kvplug; something else
with write access to the folder) could change or cut mapped bytes: a cut makes the
reader's next touch of those pages fail with SIGBUS. See docs/security.md for who may
write the folder.

What a first read costs beyond the checksum is the mapping: one page-table entry per
page, set up by page faults. On a tmpfs of 4 KiB pages (``/dev/shm`` on most hosts) that
holds a record's first read in a process to a few GB/s; on a tmpfs mounted with
``huge=always`` (2 MiB pages) it runs at about memory speed. ``extra["huge_pages"]`` says
which (:func:`kvplug_disk.mounts.huge_pages_of`), and the tier says so at start. Each process keeps the
mappings it made, up to ``keep_mapped_bytes`` (:mod:`kvplug_disk.mappings`): a record
read again from the same file is a view of the kept mapping, read at memory speed, its
checksum verified on the first read only.

A mapping lives as long as any view of it, and an unlinked file's pages with it: a view
a caller holds, or another process's kept mapping, keeps an evicted record's memory
until it goes. So each mapping is a :class:`kvplug.MappedFile`, whose views a tier that keeps
the buffers it is given (``cpu``) copies rather than keeps: a value promoted from here
never holds the folder's memory. When the kernel refuses a mapping
(``vm.max_map_count``), the record is read into memory instead, counted as
``extra["map_fallbacks"]``.

When the tmpfs itself is full (ENOSPC, before ``max_bytes`` binds), a write evicts one
record at a time, asking the file system after each what is free (``statvfs``), and
stops as soon as the record fits (:meth:`ShmBackend._make_room`). An eviction that frees
nothing (the record's pages are still mapped somewhere) ends it: the write is dropped,
and until memory comes back writes that find the tmpfs full are dropped without
evicting, rather than evicting record after record for no room (:mod:`kvplug_disk.room`;
``extra["enospc_in_vain"]`` counts such evictions).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from kvplug import (
    RECORD_HEADER_SIZE,
    Buffer,
    MappedFile,
    Medium,
    RecordToWrite,
    Tenancy,
    TierContext,
    check_record_size,
    key_digest,
    unpack_record,
)
from kvplug_disk.backend import DiskBackend
from kvplug_disk.config import DiskTierConfig, ShmTierConfig
from kvplug_disk.files import PRIVATE_FOLDER, RecordFolder
from kvplug_disk.ledger import FolderLockTimeoutError, Usage
from kvplug_disk.mappings import MappedRecords
from kvplug_disk.mounts import MEMORY_FILE_SYSTEMS, file_system_of, huge_pages_of
from kvplug_disk.problems import WARN_INTERVAL_S, ProblemLog
from kvplug_disk.room import InVain, Room
from kvplug_disk.tier import DiskTier

# No MAP_POPULATE: the checksum's first touch faults pages in 64 KiB at a time (the
# kernel's fault-around for files), where MAP_POPULATE walks them one 4 KiB page at a
# time: a map and a checksum of 96 MiB on a 4 KiB-page tmpfs took 0.81x as long
# without it (median of 15 pairs, 2-core VM).
_MAP_FLAGS = mmap.MAP_SHARED


class ShmBackend(DiskBackend):
    """A :class:`DiskBackend` whose reads map the record files instead of copying them."""

    def __init__(
        self, config: DiskTierConfig, problems: ProblemLog, tenancy: Tenancy | None = None, **options: Any
    ) -> None:
        super().__init__(config, problems, tenancy, **options)
        self._counts["map_fallbacks"] = 0
        self.file_system = file_system_of(config.path)
        self.huge_pages = huge_pages_of(config.path)
        kept = getattr(config, "keep_mapped_bytes", None)
        #: The mappings this process keeps between reads (:mod:`kvplug_disk.mappings`).
        self.mapped = MappedRecords(int(config.max_bytes if kept is None else kept), self._stat_quietly)
        self._problems.counts["enospc_in_vain"] = 0
        self._in_vain = InVain()
        self._in_vain_warned: float | None = None

    def _open_folder(self, config: DiskTierConfig) -> RecordFolder:
        """The folder, made 0700 when missing; refused, before anything is made or cleaned
        in it, when it is a symbolic link, or unless this user owns it and no one else may
        read or write it: its parent (/dev/shm) is open to every user of the host."""
        if self.read_only:  # for inspection: a store, opened as it is and never written
            return super()._open_folder(config)
        config.path.mkdir(mode=PRIVATE_FOLDER, parents=True, exist_ok=True)
        try:  # never a link planted at the path: records would go wherever it points
            fd = os.open(config.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            raise PermissionError(errno.EPERM, f"tier shm refuses the folder: {_LINK}", str(config.path)) from None
        try:
            checked = os.fstat(fd)  # the folder itself, wherever a link led
        finally:
            os.close(fd)
        problem = not_private(checked)
        if problem is None:
            folder = RecordFolder(config.path, fsync=False)
            opened = os.fstat(folder.root_fd)
            if (opened.st_dev, opened.st_ino) == (checked.st_dev, checked.st_ino):
                return folder
            folder.close()
            problem = "it was replaced while it was opened"
        raise PermissionError(errno.EPERM, f"tier shm refuses the folder: {problem}", str(config.path))

    def _load(self, digest: str) -> tuple[Buffer, os.stat_result] | None:
        opened = self._folder.open_record(digest)
        if opened is None:
            return None
        fd, info = opened
        try:
            check_record_size(os.pread(fd, RECORD_HEADER_SIZE, 0), info.st_size, self._record_bound())
            kept = self.mapped.reuse(digest, info)
            if kept is not None:
                return memoryview(kept), info
            mapping = map_file(fd, info.st_size)
        # No mapping to be had (vm.max_map_count, memory; ValueError: the file shrank since
        # its fstat, which only something other than kvplug does): read it into memory.
        except (OSError, ValueError):
            with self._lock:
                self._counts["map_fallbacks"] += 1
            return self._folder.read(digest, max_bytes=self._record_bound())
        finally:
            os.close(fd)  # a mapping outlives the descriptor it was made from
        if mapping is None:
            return memoryview(b""), info
        self.mapped.keep(digest, info, mapping)
        return memoryview(mapping), info

    def _make_room(self, size: int, attempt: int) -> bool:
        """After a write of ``size`` bytes found the tmpfs full: evict one record at a time,
        asking the file system after each what is free, until the write fits (``True``).
        ``False`` (the write is dropped): nothing of this process's left to evict, the
        tmpfs not full by what it says (once retried), an eviction that freed nothing (its
        pages are still mapped: the next would likely be evicted for nothing too), or one
        that did so lately with nothing freed since (:mod:`kvplug_disk.room`), or the folder's
        lock held past ``lock_wait_s``."""
        try:
            with (
                self._ledger.locked(
                    timeout_s=self._lock_wait_s, then="no room was made in the full tmpfs: the write is dropped"
                ) as usage,
                self._lock,
            ):
                return self._evict_until_it_fits(usage, size, attempt)
        except FolderLockTimeoutError as exc:
            self._problems.error("evict", "the folder", exc)
            return False

    def _evict_until_it_fits(self, usage: Usage, size: int, attempt: int) -> bool:
        """:meth:`_make_room`'s evictions (both locks held)."""
        room = Room.of(self._folder.root_fd)
        if room is None or self._in_vain.held_off(room):
            return False
        if room.fits(size):  # full by something statvfs does not show, or freed meanwhile
            return attempt == 0
        while not room.fits(size):
            victims = self._order.pop_victims(1)
            if not victims:
                return False
            if not self._remove_victims(usage, victims):  # pinned by another process: kept
                continue
            self._problems.counts["enospc_evictions"] += len(victims)
            after = Room.of(self._folder.root_fd)
            if after is None:
                return False
            if not after.more_than(room):
                self._evicted_in_vain(after)
                return False
            room = after
        return True

    def _temp_written(self, record: RecordToWrite) -> None:
        self._in_vain.wrote(record.size)

    def _evicted_in_vain(self, room: Room) -> None:
        self._in_vain.freed_nothing(room)
        self._problems.counts["enospc_in_vain"] += 1
        now = time.monotonic()
        if self._in_vain_warned is not None and now - self._in_vain_warned < WARN_INTERVAL_S:
            return
        self._in_vain_warned = now
        self._problems.logger.warning(
            "tier shm: %s is full, and evicting a record freed no memory (its pages are still mapped: a view "
            "some process holds, or another process's kept mapping); writes that find it full are dropped "
            "without evicting until memory comes back (counted as enospc_in_vain)",
            self.where,
        )

    def _stat_quietly(self, digest: str) -> os.stat_result | None:
        return None if self._skipped(digest) else self._folder.stat(digest)

    def _unlink_record(self, usage: Usage, digest: str, op: str) -> bool:
        self.mapped.forget([digest])  # evicted or removed here: its pages go with the last view
        return super()._unlink_record(usage, digest, op)

    def shut(self) -> None:
        self.mapped.close()
        super().shut()

    def describe(self) -> dict[str, int | float | str]:
        return {
            **super().describe(),
            **self.mapped.describe(),
            "file_system": self.file_system,
            "huge_pages": self.huge_pages,
        }


class ShmTier(DiskTier):
    """Byte buffers as records in a shared-memory folder, mapped on read (see the module docstring)."""

    name = "shm"
    medium: ClassVar[Medium] = "memory"
    Config: ClassVar[type[DiskTierConfig]] = ShmTierConfig
    backend_class: ClassVar[type[DiskBackend]] = ShmBackend

    @classmethod
    def preflight(cls, config: DiskTierConfig) -> None:  # type: ignore[override]
        """The folder can be created and written, and is private when it exists."""
        super().preflight(config)
        try:
            found = os.lstat(config.path)
        except FileNotFoundError:
            return
        problem = _LINK if stat.S_ISLNK(found.st_mode) else not_private(found)
        if problem is not None:
            raise ValueError(f"{config.path}: tier shm refuses the folder: {problem}")

    @classmethod
    def location_config(cls, location: str, options: Mapping[str, Any]) -> DiskTierConfig | None:
        """None: ``kvplug store`` opens an shm folder as tier ``disk`` does (the same files)."""
        return None

    def __init__(self, config: DiskTierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        self._trust_host = isinstance(config, ShmTierConfig) and config.trust_host
        found = self.file_system
        if found not in MEMORY_FILE_SYSTEMS:
            context.logger.warning(
                "tier shm: %s is on file system %s, not tmpfs or ramfs: records are files there, "
                "read at that file system's speed (it works, without fsync)",
                config.path,
                found,
            )
        elif self.huge_pages == "never":
            context.logger.info(
                "tier shm: %s is on tmpfs with 4 KiB pages: a record's first read in a process maps its pages "
                "one by one (a few GB/s; reads from the kept mapping after that run at memory speed); "
                "on a tmpfs mounted with huge=always first reads map 2 MiB pages, at about memory speed",
                config.path,
            )

    def unpack(self, data: Buffer, key: str) -> memoryview:
        # trust_host: the operator vouches for every writer of the folder (docs/security.md).
        if self._trust_host:
            return unpack_record(data, key, check_value=False)
        # A kept mapping verified on an earlier read: kvplug never writes a record file in place.
        mapped = self._disk.mapped if isinstance(self._disk, ShmBackend) else None
        digest = key_digest(key).hex()
        verified = mapped is not None and mapped.verified(digest, data)
        value = unpack_record(data, key, check_value=not verified)
        if mapped is not None and not verified:
            mapped.mark_verified(digest, data)
        return value

    @property
    def file_system(self) -> str:
        """The type of the file system holding the folder (``tmpfs``, ``ext4``, ``unknown``)."""
        backend = self._disk
        return backend.file_system if isinstance(backend, ShmBackend) else "unknown"

    @property
    def huge_pages(self) -> str:
        """How the folder's tmpfs uses 2 MiB pages (:func:`kvplug_disk.mounts.huge_pages_of`)."""
        backend = self._disk
        return backend.huge_pages if isinstance(backend, ShmBackend) else "-"


def not_private(found: os.stat_result) -> str | None:
    """Why a folder with this stat is not fit to hold this user's shared records, or None.
    Whoever may write there may plant records (checksummed, not signed, unless
    ``integrity_key`` is set) or cut a mapped file short under a reader."""
    if found.st_uid != os.geteuid():
        return f"it is owned by uid {found.st_uid}, not by this user (uid {os.geteuid()})"
    if found.st_mode & 0o077:
        return f"others may read or write it (mode {stat.S_IMODE(found.st_mode):04o}; chmod 0700 it)"
    return None


#: Why a symbolic link at the configured path is refused (as the lookup-socket folder refuses one).
_LINK = "it is a symbolic link (another user could have planted it to receive the records); name the folder itself"


def map_file(fd: int, size: int) -> MappedFile | None:
    """A read-only shared mapping of the first ``size`` bytes of the file open as ``fd``
    (unmapped when it and the last view of it are released); ``None`` for an empty file,
    which mmap refuses (an empty record is corrupt anyway)."""
    if size == 0:
        return None
    return MappedFile(fd, size, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
