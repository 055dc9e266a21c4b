"""The store of tier ``disk``: record files in a folder, under one budget for every process.

A :class:`kvplug.RecordBackend` that keeps the tier's ``max_bytes`` itself
(``keeps_budget``): the folder's total lives in its ledger (:mod:`kvplug_disk.ledger`),
and a write makes room, under the folder's lock, by unlinking the files this process
knows of in the order of its ``eviction`` policy (:mod:`kvplug_disk.index`), listing the
folder first when all it knows of would not be enough. What it unlinked goes to the tier through
:meth:`take_evicted`.

- A write is a temp file (``write_threads`` at once, so fdatasyncs overlap:
  :mod:`kvplug_disk.temp_writes`), renamed
  over the record's name in the order given, then its folder is fsynced as a group
  with others: on the tier's ``flush``/``settle``, at least every
  ``FOLDER_SYNC_INTERVAL_S``, and on close (see :mod:`kvplug_disk.files`).
- Every call is blocking file I/O, run by the tier on the calling thread
  (``runs_inline``: a read from the page cache costs less than a thread hop); a file
  operation that fails is counted (:mod:`kvplug_disk.problems`), never raised: a read
  is then a miss, a write a dropped put.
- Reads are :mod:`kvplug_disk.reads`': a record's size is checked before it is read.
- Opened ``read_only`` (``kvplug store stats|ls|verify``, ``kvplug explain``) it refuses
  a folder that is not a store (:func:`kvplug_disk.location.require_disk_store`) and
  then creates, changes and removes nothing: no folders, no ledger or marker, no temp
  cleanup, no mtimes; writes and removals fail.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

from kvplug import (
    FOLDER_PINNED_BYTES,
    FOLDER_TENANT_BYTES,
    RECORD_HEADER_SIZE,
    CallSizes,
    NameTenants,
    RecordBackend,
    RecordToWrite,
    SharedPins,
    StoredRecord,
    Tenancy,
)
from kvplug_disk.budget import FolderBudget
from kvplug_disk.config import DiskTierConfig
from kvplug_disk.files import RecordFolder, TempFile, make_private
from kvplug_disk.folder_pins import FolderPins, KeptForOthers
from kvplug_disk.folder_scan import ForeignEntryError, ScanResult
from kvplug_disk.index import EvictionIndex, IndexEntry, record_guard
from kvplug_disk.ledger import FolderLockTimeoutError, Usage, UsageLedger
from kvplug_disk.location import mark_store, require_disk_store
from kvplug_disk.pin_marks import PinMarks
from kvplug_disk.problems import ProblemLog, is_undeletable
from kvplug_disk.reads import DiskReads
from kvplug_disk.removals import DiskRemovals, ReadOnlyStoreError
from kvplug_disk.temp_writes import TempWriter
from kvplug_disk.tenant_tags import record_tag

#: Longest a renamed record waits for its folder's fsync while puts keep coming (a busy queue).
FOLDER_SYNC_INTERVAL_S = 1.0


class SkippedEntryError(OSError):
    """A record's name is held by an entry the tier leaves alone (a folder, a link, an
    undeletable file): the write is dropped. The entry itself was logged once, when found."""

    def __init__(self) -> None:
        super().__init__(errno.EEXIST, "an entry the tier leaves alone holds the record's name")


class RefusedRecordError(OSError):
    """No room for the record: the pinned records (or its tenant's quota) leave less than it
    needs, so it is not stored rather than evicting everything else and then itself. The
    guard counted and logged it (``stores_refused:<reason>``)."""

    def __init__(self) -> None:
        super().__init__(errno.ENOSPC, "no room beside the pinned records or within the tenant's quota")


class DiskBackend(FolderPins, DiskRemovals, FolderBudget, DiskReads, RecordBackend):
    """Record files in one folder shared by any number of processes (see the module docstring)."""

    # One put is one call: its records are renamed in order, with mtimes in that order.
    call_sizes = CallSizes(query=1024, read=16, write=1 << 20, write_bytes=1 << 62)
    keeps_budget: ClassVar[bool] = True
    runs_inline: ClassVar[bool] = True
    #: A record's mtime is the LRU clock: a read moves it.
    listed_time: ClassVar[str] = "last used"

    def __init__(
        self,
        config: DiskTierConfig,
        problems: ProblemLog,
        tenancy: Tenancy | None = None,
        *,
        read_only: bool = False,
        record_bound: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.where = str(config.path)
        self.read_only = read_only
        self._record_bound = record_bound  # the tier's max_record_bytes, read at each read
        self._budget = int(config.max_bytes)
        #: Longest a write, removal or unpin waits for the folder's lock (``FolderLockTimeoutError``).
        self._lock_wait_s = config.lock_wait_s
        self._problems = problems
        # Taken inside the ledger's lock, never around it: a write waiting for another process's
        # hold on the folder (a process paused mid-write) must not hold up this process's lookups.
        self._lock = threading.Lock()
        tenancy = tenancy or Tenancy()
        #: The tenants of record names: the tier notes the keys it is asked about here.
        self.tenant_names = NameTenants(tenancy.tenants)
        quota_salts = set(tenancy.labels.quota_salts(config.quota_bytes()[0]))
        self._tenant_salts = lambda: tenancy.tenants.salts() | quota_salts
        self._label = lambda salt: tenancy.labels.label(salt, quota_salts)
        # Every process's pins of the folder within folder_pin_max_bytes: the others' figures read
        # from their lock files (pin_owners.py) at each pin decision; self._marks is made below.
        shared = SharedPins(config.folder_pin_budget(), self._others_pinned, "folder_pin_max_bytes")
        guard = record_guard(config, tenancy, self.tenant_names, problems.logger, self.where, shared)
        self._order = EvictionIndex(config.eviction, guard, self._pinned_changed)
        self._counts = dict.fromkeys(
            (
                "discovered",
                "vanished",
                "skipped_writes",
                "folder_listings",
                "kept_pinned_elsewhere",
                "stores_refused_no_room",
            ),
            0,
        )
        self._evicted: dict[str, StoredRecord] = {}  # by digest: a record written again is no longer evicted
        self._dirty_folders: set[str] = set()
        self._folder_lock = threading.Lock()  # one folder sync at a time
        self._folders_synced_at = time.monotonic()
        started = time.perf_counter()
        self._folder = self._open_folder(config)
        self._marks = PinMarks(
            self._folder.root_fd, self._folder, read_only=read_only, logger=problems.logger, where=self.where
        )
        self._kept = KeptForOthers()  # records left for other processes' pins
        if not read_only:
            mark_store(self._folder.root_fd)
        self._ledger = UsageLedger(self._folder.root_fd, where=self.where, read_only=read_only)
        self._ledger.before_release = self._write_figure  # (the pin figure: FolderPins._pinned_changed)
        try:
            scan = self._start(config)
        except BaseException:  # a tier that does not open keeps no descriptors
            self._ledger.close()
            self._folder.close()
            raise
        self._startup = {
            "startup_s": round(time.perf_counter() - started, 4),
            "temps_removed": scan.temps_removed,
            "temps_kept": scan.temps_kept,
        }
        self._temps = TempWriter(
            self._folder, self.tenant_names, self._make_room, self._temp_written, config.write_threads
        )

    def _start(self, config: DiskTierConfig) -> ScanResult:
        """List the folder and index its records, under the folder's lock: the scan and the
        total it gives are exact, not racing a writer. A lock held past ``open_lock_wait_s``
        (a process paused holding it) fails the open: ``FolderLockTimeoutError`` names the folder."""
        with (
            self._ledger.locked(
                timeout_s=config.open_lock_wait_s,
                then="the tier does not open (it can once that process goes on or ends)",
            ) as usage,
            self._lock,
        ):
            scan = self._list(usage, clean_temps_older_than=None if self.read_only else config.stale_temp_s)
            for entry in scan.foreign:  # "<shard>/<digest>.kvr", or a shard name
                shard, _, name = entry.partition("/")
                what = "is not a regular file or folder" if name else "is not a folder this user may open"
                self._problems.skip(name[:64] or shard, "foreign", f"{config.path}/{entry} {what}")
            self._rebuild(usage, scan)
            if not self.read_only:
                self._marks.sweep()  # lock files of engines that are gone
                self._evict_for(usage, 0)  # the budget may have shrunk since the last run
            # The tier's start-up listing: the files still there, without listing twice.
            self._startup_listing: list[StoredRecord] | None = [
                StoredRecord(digest, size, mtime_ns / 1e9)
                for digest, size, mtime_ns in scan.records
                if digest in self._order
            ]
        return scan

    def _open_folder(self, config: DiskTierConfig) -> RecordFolder:
        """The store folder, made 0700 (its records are 0600): others on the host must not
        read cached KV, which is prompts. A folder of this user's that others could read is
        made private, saying so; another user's folder is used as it is (not ours to change).
        ``read_only``: a store (else ``ValueError``), opened as it is."""
        if self.read_only:
            require_disk_store(str(config.path))
            return RecordFolder(config.path, fsync=False, create=False)
        folder = RecordFolder(config.path, fsync=config.fsync)
        was = make_private(folder.root_fd)
        if was is not None:
            self._problems.logger.warning(
                "tier disk: %s was mode %04o (other users could read cached KV, i.e. prompts); made it 0700",
                config.path,
                was,
            )
        return folder

    # --- writes ---------------------------------------------------------------------

    async def write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        if self.read_only:
            return [ReadOnlyStoreError(self.where) for _ in records]
        return self._write(records)

    def _write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        outcomes: list[BaseException | None] = [None] * len(records)
        wanted = []
        for i, record in enumerate(records):
            if self._skipped(record.name):  # a folder or an undeletable file holds its name
                with self._lock:
                    self._counts["skipped_writes"] += 1
                outcomes[i] = SkippedEntryError()
            else:
                wanted.append(i)
        temps = self._temps.write([records[i] for i in wanted])
        busy: FolderLockTimeoutError | None = None  # the folder's lock stayed held: the rest of the put is dropped
        try:
            for i, temp in zip(wanted, temps):
                record = records[i]
                if isinstance(temp, OSError):
                    outcomes[i] = SkippedEntryError() if self._entry_failed("write", record.name, temp) else temp
                elif busy is not None:
                    self._folder.discard_temp(temp)
                    outcomes[i] = busy
                else:
                    try:
                        locked = self._ledger.locked(timeout_s=self._lock_wait_s, then="the write is dropped")
                        with locked as usage, self._lock:
                            outcomes[i] = self._publish(usage, record, temp)
                    except FolderLockTimeoutError as exc:
                        busy = outcomes[i] = exc
                        self._folder.discard_temp(temp)
                        self._problems.error("write", "the folder", exc, warn=False)  # the tier warns of drops
                    if outcomes[i] is None:
                        with self._folder_lock:
                            self._dirty_folders.add(self._folder.shard_of(record.name))
        finally:  # a call that failed half-way (the folder could not be listed) leaves no temp file open
            for temp in temps:
                if isinstance(temp, TempFile):
                    self._folder.discard_temp(temp)  # (nothing for one published or discarded already)
        if time.monotonic() - self._folders_synced_at >= FOLDER_SYNC_INTERVAL_S:
            self._sync_folders()  # the rest on flush
        return outcomes

    def _temp_written(self, record: RecordToWrite) -> None:
        """A record's temp file was written (before it is published, maybe on an I/O thread)."""

    def _publish(self, usage: Usage, record: RecordToWrite, temp: TempFile) -> BaseException | None:
        """Make room for a written temp file and rename it into place (both locks held); why not, if not."""
        entry = IndexEntry(record.value.nbytes, record.size)
        if not self._order.admits(record.name, entry, self._budget):
            self._folder.discard_temp(temp)
            return RefusedRecordError()
        # Replaced below: it must not count against its own room, nor be evicted for it.
        # A pinned record is neither, and stays pinned (stored again, its pin takes the new size).
        replaced = not self._order.is_pinned(record.name) and self._order.pop(record.name) is not None
        self._evict_for(usage, entry.value_size)
        old_tag = record_tag(self._folder, record.name) if usage.tenants is not None else None
        old_size = self._value_size_on_disk(record.name)
        growth = entry.value_size - old_size
        if usage.total + growth > self._budget:  # what is left is pinned by other processes (pin marks)
            self._counts["stores_refused_no_room"] += 1
            self._folder.discard_temp(temp)
            return RefusedRecordError()
        self._marks.carry_over(record.name, temp.name, temp.dir_fd)  # other engines' pins of the old file
        usage.total += growth
        usage.add_tenant(old_tag, -(old_size + RECORD_HEADER_SIZE))
        usage.add_tenant(temp.tag, record.size)
        usage.save()  # before the rename: a crash in between over-counts, never under-counts
        try:
            self._folder.publish(temp, record.name)
        except OSError as exc:
            usage.total -= growth
            usage.add_tenant(temp.tag, -record.size)
            usage.add_tenant(old_tag, old_size + RECORD_HEADER_SIZE)
            self._folder.discard_temp(temp)
            skipped = self._entry_failed("publish", record.name, exc, locked=True)
            return SkippedEntryError() if skipped else exc
        # Evicted earlier in this put (or by another thread's) and now written again:
        # the tier must not forget the record it has just stored, nor report it gone.
        self._evicted.pop(record.name, None)
        self._kept.drop(record.name)
        self._order.add(record.name, entry)
        if replaced:  # storing a record again is a use of it
            self._order.touch(record.name)
        self._mark_new_pins([record.name])
        self._unmark_if_due()
        over_quota = self._order.take_over_quota()  # the tenant's own records
        if over_quota:
            self._remove_victims(usage, over_quota)
        if temp.tag is not None and (tenant := self.tenant_names.tenant_of(record.name)) is not None:
            self._keep_folder_quota(usage, tenant, temp.tag)  # the tenant's records of every process
        return None

    # --- lifecycle ------------------------------------------------------------------

    async def flush(self) -> None:
        self._sync_folders()

    def _sync_folders(self) -> None:
        with self._folder_lock:
            folders, self._dirty_folders = self._dirty_folders, set()
            self._folders_synced_at = time.monotonic()
            try:
                self._folder.sync_dirs(folders)
            except OSError as exc:
                self._problems.error("fsync", "folders", exc)

    async def close(self) -> None:
        self.shut()

    def shut(self) -> None:
        """Close the files (also without the tier's loop, for a tier that failed to start)."""
        self._temps.close()
        self._sync_folders()
        self._marks.close()
        self._ledger.close()
        self._folder.close()

    def errors(self) -> int:
        return self._problems.errors

    def describe(self) -> dict[str, int | float | str]:
        folder = self._marks.figures(others_only=True)  # (read before the lock: file I/O)
        with self._lock:
            return {
                # Every live process's pinned bytes in the folder, this one's as it holds them now.
                FOLDER_PINNED_BYTES: folder.pinned_bytes + self._order.pinned_bytes,
                "folder_pinning_processes": folder.pinning + int(self._order.pinned_bytes > 0),
                "folder_pins_unknown_processes": folder.unknown,
                **self._counts,
                **self._problems.counts,
                **self._marks.counts,
                **self._startup,
                "file_bytes": self._order.file_bytes,
                **self._order.stats_extra(),
                "eviction": self._order.eviction,
                "folder_bytes": self._ledger.peek(),
                "folder_budget_shared": int(self._ledger.shared),
                **{FOLDER_TENANT_BYTES + label: held for label, held in self._folder_tenant_bytes(self._label).items()},
                "path": self.where,
            }

    # --- helpers --------------------------------------------------------------------

    def _skipped(self, digest: str) -> bool:
        return self._problems.is_skipped(digest) or self._problems.is_skipped(digest[:2])

    def _entry_failed(self, op: str, digest: str, exc: OSError, *, locked: bool = False) -> bool:
        """Count a failed file operation; an entry that is in the way for good (not a
        regular file, not ours to remove or replace) is skipped from now on (``True``).
        A failed write is warned about by the tier, as a dropped put."""
        warn = op not in ("write", "publish")
        if isinstance(exc, ForeignEntryError):
            self._problems.skip(exc.filename or digest, "foreign", exc.strerror)
        elif is_undeletable(exc) and op in ("evict", "remove", "unlink", "publish"):
            kind = "foreign" if exc.errno in (errno.EISDIR, errno.ENOTEMPTY) else "undeletable"
            self._problems.skip(digest, kind, exc)
        else:
            self._problems.error(op, digest, exc, warn=warn)
            return False
        with contextlib.nullcontext() if locked else self._lock:
            self._order.pop(digest)  # (if it was pinned, the order tells: FolderPins._pinned_changed)
        if not warn:
            self._problems.error(op, digest, exc, warn=False)
        return True
