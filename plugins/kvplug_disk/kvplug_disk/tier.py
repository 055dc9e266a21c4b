"""Tier ``disk``: one crash-safe record file per key in a folder, LRU within a byte budget.

- Writes are atomic per key (temp file, fdatasync, rename, folder fsync; see
  :mod:`kvplug_disk.files`). ``put`` writes before it returns; by default the tier
  chain calls it from the write queue it keeps for the tier (``queue.mode: async``,
  see :mod:`kvplug_disk.config`), which serves values still queued from memory. The
  folders renamed into are fsynced as a group: on ``settle`` (which the chain calls
  when the tier's queue runs empty), at least every ``FOLDER_SYNC_INTERVAL_S``, and on
  ``flush``/``close``. A rename not yet synced can only be lost by a power failure, and then
  the key is simply absent: the file's data was synced before the rename, so a name
  never points at torn bytes.
- Every read verifies the record frame (magic, version, length, key digest,
  checksums). A bad file is a miss, counted as ``extra["corrupt"]``, and removed.
- The index (digest -> size, LRU order) is rebuilt from the folder at start, so
  a new process finds what the last one stored.
- Several processes may share the folder. ``contains`` and ``get`` ask the file
  system, not only the index, so they see files another process wrote, and a file
  another process evicted is a miss, never an error. Each process enforces the
  budget over the files it knows of (those found at start, written or seen since).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvplug import (
    RECORD_HEADER_SIZE,
    Buffer,
    KVEvent,
    StorageTier,
    StoredRecord,
    TierContext,
    TierStats,
    unpack_record,
)
from kvplug.errors import CorruptChunkError, IncompatibleChunkError, TierClosedError, ValueTooLargeError
from kvplug_disk.config import DiskTierConfig
from kvplug_disk.files import ForeignEntryError, RecordFolder, TempFile, digest_of, value_size_of
from kvplug_disk.index import IndexEntry, LRUIndex
from kvplug_disk.ledger import Usage, UsageLedger
from kvplug_disk.location import disk_location_config
from kvplug_disk.preflight import check_folder
from kvplug_disk.problems import ProblemLog, is_no_space, is_undeletable

#: Longest a renamed record waits for its folder's fsync while puts keep coming (a busy queue).
FOLDER_SYNC_INTERVAL_S = 1.0
#: On a full disk, rounds of evicting this tier's oldest records (each twice the last) before a write gives up.
NO_SPACE_ROUNDS = 4


@dataclass(frozen=True)
class _Write:
    """One value of a put, and the digest that names its file."""

    key: str
    digest: str
    value: Buffer


class DiskTier(StorageTier):
    """Byte buffers as verified record files in a folder shared by any number of processes."""

    name = "disk"
    medium = "disk"
    Config = DiskTierConfig

    @classmethod
    def location_config(cls, location: str, options: Mapping[str, Any]) -> DiskTierConfig | None:
        """A folder path or ``file://`` URL that a disk tier wrote (see :mod:`kvplug_disk.location`)."""
        return disk_location_config(location, options)

    @classmethod
    def preflight(cls, config: DiskTierConfig) -> None:  # type: ignore[override]
        """The folder can be created and written (:func:`kvplug_disk.preflight.check_folder`)."""
        check_folder(config.path)

    def __init__(self, config: DiskTierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        self.config: DiskTierConfig = config
        self._budget = int(config.max_bytes)
        self._lock = threading.Lock()
        self._index = LRUIndex()
        self._stats = TierStats()
        self._counts = {"corrupt": 0, "incompatible": 0, "discovered": 0, "vanished": 0, "skipped_writes": 0}
        self._problems = ProblemLog(context.logger, self._error_counter(context))
        self._closed = False
        self._dirty_folders: set[str] = set()
        self._folder_lock = threading.Lock()  # one folder sync at a time; taken before _lock, never inside it
        self._folders_synced_at = time.monotonic()
        started = time.perf_counter()
        self._folder = RecordFolder(config.path, fsync=config.fsync)
        self._ledger = UsageLedger(self._folder.root_fd)
        # Under the folder's lock: the scan and the total it gives are exact, not racing a writer.
        with self._lock, self._ledger.locked() as usage:
            scan = self._folder.scan(clean_temps_older_than=config.stale_temp_s)
            for entry in scan.foreign:  # "<shard>/<digest>.kvr", or a shard name
                shard, _, name = entry.partition("/")
                self._problems.skip(
                    name[:64] or shard, "foreign", f"{config.path}/{entry} is not a regular file or folder"
                )
            self._rebuild_index(usage, scan.records)
            self._startup = {
                "startup_s": round(time.perf_counter() - started, 4),
                "temps_removed": scan.temps_removed,
                "temps_kept": scan.temps_kept,
            }
            self._evict_for(usage, 0)  # the budget may have shrunk since the last run
        # fdatasync releases the GIL: records written on several threads overlap their waits.
        self._io = (
            ThreadPoolExecutor(config.write_threads, thread_name_prefix="kvplug-disk-io")
            if config.write_threads > 1
            else None
        )

    # --- reads ----------------------------------------------------------------------

    def contains(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        found = []
        for key in keys:
            digest = digest_of(key)
            if self._skipped(digest):
                found.append(False)
                continue
            # A stat per key: cheap, and the truth when other processes share the folder.
            try:
                stat = self._folder.stat(digest)
            except OSError as exc:
                self._entry_failed("stat", digest, exc)
                stat = None
            with self._lock:
                self._reconcile(digest, key, stat)
            found.append(stat is not None)
        return found

    def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        self._check_open()
        return [self._get_one(key) for key in keys]

    def _get_one(self, key: str) -> Buffer | None:
        digest = digest_of(key)
        if self._skipped(digest):
            with self._lock:
                self._stats.misses += 1
            return None
        try:
            found = self._folder.read(digest)
        except OSError as exc:
            self._entry_failed("read", digest, exc)
            with self._lock:
                self._stats.misses += 1
            return None
        if found is None:
            with self._lock:
                self._reconcile(digest, key, None)
                self._stats.misses += 1
            return None
        data, stat = found
        try:
            value = unpack_record(data, key)
        except CorruptChunkError as exc:
            self.context.logger.warning("disk tier: %s is corrupt (%s); removed", self._folder.path_of(digest), exc)
            with self._lock, self._ledger.locked() as usage:
                try:
                    if self._folder.unlink_if_same(digest, stat):
                        usage.total -= value_size_of(stat.st_size)
                except OSError as unlink_error:
                    self._entry_failed("unlink", digest, unlink_error, locked=True)
                self._counts["corrupt"] += 1
                self._stats.misses += 1
                self._index.pop(digest)
            return None
        except IncompatibleChunkError:
            # Another kvplug version's record: a miss here, but its own readers may want it.
            with self._lock:
                self._counts["incompatible"] += 1
                self._stats.misses += 1
            return None
        with self._lock:
            self._reconcile(digest, key, stat)
            self._index.touch(digest, key)
            self._stats.hits += 1
        self._folder.touch(digest)
        return value

    def scan(self) -> Iterator[tuple[str, int]]:
        """``(key, value bytes)`` of every record file; the digest where the key is unknown
        to this process (files store only the key's digest)."""
        self._check_open()
        for digest, file_size, _ in self._folder.scan().records:
            with self._lock:
                entry = self._index.get(digest)
                name = entry.key if entry is not None and entry.key is not None else digest
            yield name, value_size_of(file_size)

    # --- maintenance (kvplug.RecordStore) -----------------------------------------------

    def records(self) -> Iterator[StoredRecord]:
        """Every record file: its key digest, file size and modification time."""
        self._check_open()
        for digest, file_size, mtime_ns in self._folder.scan().records:
            yield StoredRecord(digest, file_size, mtime_ns / 1e9)

    def read_record(self, digest: str) -> bytes | None:
        """The whole record file (header and value), unverified."""
        self._check_open()
        try:
            found = self._folder.read(digest)
        except OSError as exc:
            self._entry_failed("read", digest, exc)
            return None
        return None if found is None else found[0]

    def delete_record(self, digest: str) -> bool:
        self._check_open()
        with self._lock, self._ledger.locked() as usage:
            self._index.pop(digest)
            return self._unlink_record(usage, digest, "unlink")

    # --- writes ---------------------------------------------------------------------

    def put(self, items: Sequence[tuple[str, Buffer]]) -> None:
        self._check_open()
        writes = []
        for key, value in items:
            view = memoryview(value)
            if not view.c_contiguous:  # before any file: a whole batch refused
                raise TypeError(f"value for {key} is not a C-contiguous buffer")
            size = view.nbytes
            if size > self._budget:
                raise ValueTooLargeError(
                    f"value of {size} bytes for {key} exceeds max_bytes {self._budget} of tier disk"
                )
            writes.append(_Write(key, digest_of(key), value))
        self._write_batch(writes)

    def _write_batch(self, writes: list[_Write]) -> None:
        wanted = [write for write in writes if self._still_wanted(write)]
        for write, temp in zip(wanted, self._write_temps(wanted)):
            if isinstance(temp, OSError):
                self._entry_failed("write", write.digest, temp)
                continue
            evicted: list[str] = []
            with self._lock, self._ledger.locked() as usage:
                self._index.pop(write.digest)  # replaced below; must not count against its own room
                value_size = memoryview(write.value).nbytes
                evicted = self._evict_for(usage, value_size)
                growth = value_size - self._value_size_on_disk(write.digest)
                usage.total += growth
                usage.save()  # before the rename: a crash in between over-counts, never under-counts
                try:
                    self._folder.publish(temp, write.digest)
                except OSError as exc:
                    usage.total -= growth
                    self._folder.discard_temp(temp)
                    self._entry_failed("publish", write.digest, exc, locked=True)
                else:
                    self._index.add(write.digest, IndexEntry(value_size, value_size + RECORD_HEADER_SIZE, write.key))
                    self._stats.puts += 1
            with self._folder_lock:
                self._dirty_folders.add(self._folder.shard_of(write.digest))
            if evicted:
                self.context.emit(KVEvent("evicted", tuple(evicted), tier=self.name))
        if time.monotonic() - self._folders_synced_at >= FOLDER_SYNC_INTERVAL_S:
            self._sync_folders()  # the rest on settle: the chain calls it when the queue runs empty

    def _still_wanted(self, write: _Write) -> bool:
        if self._skipped(write.digest):  # a folder or an undeletable file holds its name
            with self._lock:
                self._counts["skipped_writes"] += 1
            return False
        return True

    def _write_temps(self, writes: list[_Write]) -> list[TempFile | OSError]:
        """The temp files of ``writes`` (or why one failed), up to ``write_threads`` written at once.

        Their mtimes (the LRU order a restart rebuilds) follow the order of ``writes``,
        whichever finishes first.
        """
        start = time.time_ns()
        stamps = range(start, start + len(writes))
        if self._io is None or len(writes) < 2:
            return [self._write_temp_or_error(write, stamp) for write, stamp in zip(writes, stamps)]
        return list(self._io.map(self._write_temp_or_error, writes, stamps))

    def _write_temp_or_error(self, write: _Write, mtime_ns: int) -> TempFile | OSError:
        try:
            return self._write_temp(write, mtime_ns)
        except OSError as exc:
            return exc

    def _write_temp(self, write: _Write, mtime_ns: int) -> TempFile:
        """Write the temp file; on a full disk, evict this tier's oldest records and retry."""
        needed = memoryview(write.value).nbytes + RECORD_HEADER_SIZE + 64 * 1024  # + blocks, metadata
        for attempt in range(NO_SPACE_ROUNDS + 1):
            try:
                return self._folder.write_temp(write.key, write.digest, write.value, mtime_ns=mtime_ns)
            except OSError as exc:
                if not is_no_space(exc) or attempt == NO_SPACE_ROUNDS:
                    raise
                with self._lock, self._ledger.locked() as usage:
                    victims = self._index.pop_oldest(needed << attempt)
                    evicted = self._remove_victims(usage, victims)
                    self._problems.counts["enospc_evictions"] += len(victims)
                if evicted:
                    self.context.emit(KVEvent("evicted", tuple(evicted), tier=self.name))
                if not victims:  # nothing of ours left to make room with
                    raise
        raise AssertionError("unreachable")

    def _sync_folders(self) -> None:
        with self._folder_lock:
            folders, self._dirty_folders = self._dirty_folders, set()
            self._folders_synced_at = time.monotonic()
            try:
                self._folder.sync_dirs(folders)
            except OSError as exc:
                self._problems.error("fsync", "folders", exc)

    def _evict_for(self, usage: Usage, incoming: int) -> list[str]:
        """Unlink least recently used files until ``incoming`` bytes fit in the folder's
        budget; the keys known. Called with the lock and the folder's lock held, so no
        write of the same digest, here or in another process, can slip in between.
        When this process knows of nothing more to evict, it lists the folder again:
        the rest of the total is other processes' records."""
        keys: list[str] = []
        rescanned = False
        while usage.total + incoming > self._budget:
            victims = self._index.pop_oldest(1)
            if not victims:
                if rescanned:
                    break
                self._rebuild_index(usage, self._folder.scan().records)
                rescanned = True
                continue
            keys += self._remove_victims(usage, victims)
        return keys

    def _remove_victims(self, usage: Usage, victims: list[tuple[str, IndexEntry]]) -> list[str]:
        """Unlink evicted records (locks held); the keys known. One that cannot be removed
        is skipped from then on: out of the index and the total, so the budget is kept
        with the others."""
        keys = []
        for digest, entry in victims:
            if self._unlink_record(usage, digest, "evict"):
                self._stats.evictions += 1
                if entry.key is not None:
                    keys.append(entry.key)
        return keys

    def _unlink_record(self, usage: Usage, digest: str, op: str) -> bool:
        """Remove one record file and take its bytes off the folder's total (locks held)."""
        stat = None
        try:
            stat = self._folder.stat(digest)
            if stat is None or not self._folder.unlink(digest):
                return False
        except OSError as exc:
            self._entry_failed(op, digest, exc, locked=True)
            if self._skipped(digest) and stat is not None:
                usage.total -= value_size_of(stat.st_size)  # out of the budget: nothing can make it go
            return False
        usage.total -= value_size_of(stat.st_size)
        return True

    def _value_size_on_disk(self, digest: str) -> int:
        try:
            stat = self._folder.stat(digest)
        except OSError:
            return 0
        return 0 if stat is None else value_size_of(stat.st_size)

    def _rebuild_index(self, usage: Usage, records: list[tuple[str, int, int]]) -> None:
        """Index every record of a folder listing, oldest first (LRU order by mtime),
        keeping the keys this process knows; the folder's total becomes the listing's."""
        records.sort(key=lambda record: record[2])
        old, self._index = self._index, LRUIndex()
        for digest, file_size, _ in records:
            if self._skipped(digest):
                continue
            known = old.get(digest)
            self._index.add_new(digest, IndexEntry(value_size_of(file_size), file_size, known.key if known else None))
        usage.total = self._index.value_bytes

    def remove(self, keys: Sequence[str]) -> None:
        self._check_open()
        removed = []
        with self._lock, self._ledger.locked() as usage:
            for key in keys:
                digest = digest_of(key)
                known = self._index.pop(digest) is not None
                if self._unlink_record(usage, digest, "remove") or known:
                    removed.append(key)
        if removed:
            self.context.emit(KVEvent("removed", tuple(removed), tier=self.name))

    # --- lifecycle ------------------------------------------------------------------

    def flush(self) -> None:
        """Puts are visible when they return; this fsyncs the folders renamed into since
        the last sync, as a group."""
        self._check_open()
        self._sync_folders()

    def settle(self) -> None:
        """The chain has nothing more to write here for now: sync the folders renamed into."""
        if not self._closed:
            self._sync_folders()

    def stats(self) -> TierStats:
        with self._lock:
            snapshot = TierStats(**{k: v for k, v in vars(self._stats).items() if k != "extra"})
            snapshot.bytes_used = self._index.value_bytes
            snapshot.items = len(self._index)
            snapshot.errors += self._problems.errors
            snapshot.extra = {
                **self._counts,
                **self._problems.counts,
                **self._startup,
                "file_bytes": self._index.file_bytes,
                "max_bytes": self._budget,
                "folder_bytes": self._ledger.peek(),
                "folder_budget_shared": int(self._ledger.shared),
                "path": str(self.config.path),
            }
            return snapshot

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._io is not None:
            self._io.shutdown(wait=True)
        self._sync_folders()
        self._ledger.close()
        self._folder.close()

    # --- helpers --------------------------------------------------------------------

    def _reconcile(self, digest: str, key: str, stat: os.stat_result | None) -> None:
        """Make the index agree with what the file system just said (lock held)."""
        entry = self._index.get(digest)
        if stat is None:
            if entry is not None:
                self._index.pop(digest)
                self._counts["vanished"] += 1
        elif entry is None or entry.file_size != stat.st_size:
            value_size = value_size_of(stat.st_size)
            if entry is None:
                self._counts["discovered"] += 1
            self._index.add(digest, IndexEntry(value_size, stat.st_size, key))
        elif entry.key is None:
            entry.key = key

    @staticmethod
    def _error_counter(context: TierContext) -> Callable[[str], None] | None:
        """Errors of writes reach the engine's ``kvplug_tier_errors`` counter
        (the tier chain counts only calls that raise, and failed writes are counted, not raised)."""
        metrics = getattr(context, "metrics", None)
        if metrics is None:
            return None
        label = f"{context.tier_index}:disk"
        return lambda op: metrics.tier_errors.labels(label, op).inc()

    def _skipped(self, digest: str) -> bool:
        return self._problems.is_skipped(digest) or self._problems.is_skipped(digest[:2])

    def _entry_failed(self, op: str, digest: str, exc: OSError, *, locked: bool = False) -> None:
        """Count a failed file operation; an entry that is in the way for good (not a
        regular file, not ours to remove or replace) is skipped from now on."""
        if isinstance(exc, ForeignEntryError):
            self._problems.skip(exc.filename or digest, "foreign", exc.strerror)
        elif is_undeletable(exc) and op in ("evict", "remove", "unlink", "publish"):
            kind = "foreign" if exc.errno in (errno.EISDIR, errno.ENOTEMPTY) else "undeletable"
            self._problems.skip(digest, kind, exc)
        else:
            self._problems.error(op, digest, exc)
            return
        if locked:
            self._index.pop(digest)
        else:
            with self._lock:
                self._index.pop(digest)
        if op in ("write", "publish"):
            self._problems.error(op, digest, exc)

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError("tier 'disk' is closed")
