"""The reads of tier ``disk``'s backend (:class:`~kvplug_disk.backend.DiskBackend`):
lookups, reads, inspection reads and listings.

A lookup is a ``stat`` per key, the truth when other processes share the folder, and
what it finds brings the process's eviction order up to date. A record is read only
after its size passed :func:`kvplug.check_record_size` (the length its header declares,
and the tier's ``max_record_bytes``): a sparse or forged file that claims a gigabyte is
corrupt, a miss counted and removed by the tier, without that gigabyte being allocated.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

from kvplug import Buffer, StoredRecord
from kvplug.errors import CorruptChunkError
from kvplug_disk.files import RecordFolder, value_size_of
from kvplug_disk.folder_pins import KeptForOthers
from kvplug_disk.folder_scan import ForeignEntryError
from kvplug_disk.index import EvictionIndex, IndexEntry


class DiskReads:
    """The read side of :class:`~kvplug_disk.backend.DiskBackend`, which sets the attributes below."""

    _folder: RecordFolder
    _lock: threading.Lock
    _order: EvictionIndex
    _kept: KeptForOthers
    _counts: dict[str, int]
    _startup_listing: list[StoredRecord] | None
    #: Opened for inspection: reads set no mtimes.
    read_only: bool
    #: The tier's ``max_record_bytes`` (read at each read: the engine may raise it).
    _record_bound: Callable[[], int | None]

    def _skipped(self, digest: str) -> bool:
        raise NotImplementedError

    def _entry_failed(self, op: str, digest: str, exc: OSError, *, locked: bool = False) -> bool:
        raise NotImplementedError

    def _mark_entered(self, names: list[str]) -> None:
        raise NotImplementedError

    async def sizes(self, names: Sequence[str]) -> list[int | None]:
        return self._sizes(names)

    def _sizes(self, names: Sequence[str]) -> list[int | None]:
        found: list[int | None] = []
        entered: list[str] = []
        for digest in names:
            stat = None
            if not self._skipped(digest):
                try:  # a stat per key: cheap, and the truth when other processes share the folder
                    stat = self._folder.stat(digest)
                except OSError as exc:
                    self._entry_failed("stat", digest, exc)
            with self._lock:
                if self._reconcile(digest, stat):
                    entered.append(digest)
            found.append(None if stat is None else stat.st_size)
        self._mark_entered(entered)
        return found

    async def read(self, names: Sequence[str], sizes: Sequence[int | None]) -> list[Buffer | None | BaseException]:
        return self._read(names)

    def _read(self, names: Sequence[str]) -> list[Buffer | None | BaseException]:
        return [self._read_one(digest) for digest in names]

    def _load(self, digest: str) -> tuple[Buffer, os.stat_result] | None:
        """A record's bytes and its stat (``None``: no such file); raises ``OSError``, or
        ``CorruptChunkError`` for a size that rules the record out (read no further)."""
        return self._folder.read(digest, max_bytes=self._record_bound())

    def _read_one(self, digest: str) -> Buffer | None | BaseException:
        if self._skipped(digest):
            return None
        try:
            found = self._load(digest)
        except CorruptChunkError as exc:  # the tier counts, logs and removes it
            return exc
        except OSError as exc:
            self._entry_failed("read", digest, exc)
            return None
        with self._lock:
            entered = self._reconcile(digest, None if found is None else found[1])
            if found is not None:
                self._order.touch(digest)
        if entered:
            self._mark_entered([digest])
        if found is None:
            return None
        if not self.read_only:
            self._folder.touch(digest)  # the mtime is the order a restart rebuilds
        return found[0]

    async def peek(self, names: Sequence[str], sizes: Sequence[int | None]) -> list[Buffer | None | BaseException]:
        """Read for ``kvplug store`` and ``kvplug explain``: no mtime set, no move in the
        eviction order. A record is mapped, not copied: verifying a large one allocates
        nothing of its size. A record that cannot be read (no permission) is its
        ``OSError``, never "gone"; one whose size rules it out, a ``CorruptChunkError``."""
        found: list[Buffer | None | BaseException] = []
        for digest in names:
            data: Buffer | None | BaseException = None
            if not self._skipped(digest):
                try:
                    read = self._folder.read(digest, max_bytes=self._record_bound(), mapped=True)
                except CorruptChunkError as exc:
                    data = exc
                except OSError as exc:
                    self._entry_failed("read", digest, exc)
                    data = None if isinstance(exc, ForeignEntryError) else exc  # (foreign: not a record)
                else:
                    data = None if read is None else read[0]
            found.append(data)
        return found

    async def listing(self) -> list[StoredRecord]:
        startup, self._startup_listing = self._startup_listing, None
        return startup if startup is not None else self._listing()

    def _listing(self) -> list[StoredRecord]:
        records = self._folder.scan().records
        return [StoredRecord(d, size, mtime_ns / 1e9) for d, size, mtime_ns in records if not self._skipped(d)]

    def _reconcile(self, digest: str, stat: os.stat_result | None) -> bool:
        """Make the eviction order agree with what the file system just said (lock held);
        whether the record entered it (or entered it again, another file): a record the
        engine's pin book wants is pinned as it enters, and is to be marked."""
        entry = self._order.get(digest)
        if stat is None:
            if entry is not None:
                self._order.pop(digest)
                self._counts["vanished"] += 1
        elif entry is None or entry.file_size != stat.st_size:
            if entry is None:
                self._counts["discovered"] += 1
            self._kept.drop(digest)  # (one left for another process's pin: in the order again)
            self._order.add(digest, IndexEntry(value_size_of(stat.st_size), stat.st_size))
            return True
        return False
