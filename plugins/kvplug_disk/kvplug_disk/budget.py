"""Keeping a disk tier's folder within its byte budget (:class:`FolderBudget`, a base of
:class:`~kvplug_disk.backend.DiskBackend`): eviction in the index's order, room made when the
disk is full, each tenant within its quota in the whole folder, and the index rebuilt from a
listing of the folder (with the records' tenant tags, :mod:`kvplug_disk.tenant_tags`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvplug import StoredRecord
from kvplug_disk.files import RecordFolder, value_size_of
from kvplug_disk.folder_pins import KeptForOthers
from kvplug_disk.folder_scan import ScanResult
from kvplug_disk.index import EvictionIndex, IndexEntry
from kvplug_disk.ledger import FolderLockTimeoutError, Usage, UsageLedger
from kvplug_disk.pin_marks import PinMarks
from kvplug_disk.problems import ProblemLog
from kvplug_disk.tenant_tags import record_tag, tenant_tag

#: Least time between two listings of the folder for a tenant table that is not valid: an older
#: kvplug writing into the folder makes it stale at each write, and a listing reads every record.
#: Meanwhile quotas bound what this process knows of, as before.
TENANT_RELIST_INTERVAL_S = 10.0
#: ... and at least this many times the last listing's own wall time: a listing holds the folder's
#: lock (2-3 s at 100k records), so listing again takes at most 1/(1 + 20), under 5%, of its time.
TENANT_RELIST_COST_FACTOR = 20.0
#: The monotonic clock those intervals are measured by (a module attribute: a test drives it).
clock: Callable[[], float] = time.monotonic


class FolderBudget:
    """The budget methods of a disk backend; they run with its lock (and the ledger's) held."""

    _lock: threading.Lock
    _ledger: UsageLedger
    _order: EvictionIndex
    _problems: ProblemLog
    _evicted: dict[str, StoredRecord]
    _budget: int
    _lock_wait_s: float
    _folder: RecordFolder
    _marks: PinMarks
    _kept: KeptForOthers
    _counts: dict[str, int]
    #: The salts this process knows (a tag in the folder is one of theirs, or no tenant it knows).
    _tenant_salts: Callable[[], Iterable[str]]
    #: When a listing last read the records' tenant tags (:data:`clock`), and how long it took.
    _tenants_listed_at = float("-inf")
    _tenants_listing_s = 0.0

    if TYPE_CHECKING:

        def _skipped(self, digest: str) -> bool: ...

        def _entry_failed(self, op: str, digest: str, exc: OSError, *, locked: bool = False) -> bool: ...

        def _mark_new_pins(self, names: Iterable[str]) -> None: ...

        def _unmark_if_due(self) -> None: ...

    def _make_room(self, size: int, attempt: int) -> bool:
        """After a write of ``size`` bytes found the disk full (``attempt`` times before):
        evict this process's next victims, twice as many bytes each round; whether any were
        (none: the folder's lock stayed held past ``lock_wait_s``, and the write fails on the full disk)."""
        try:
            with (
                self._ledger.locked(
                    timeout_s=self._lock_wait_s, then="no room was made on the full disk: the write is dropped"
                ) as usage,
                self._lock,
            ):
                victims = self._order.pop_victims((size + 64 * 1024) << attempt)  # + blocks, metadata
                self._remove_victims(usage, victims)
                self._problems.counts["enospc_evictions"] += len(victims)
        except FolderLockTimeoutError as exc:
            self._problems.error("evict", "the folder", exc)
            return False
        return bool(victims)

    def take_evicted(self) -> list[StoredRecord]:
        with self._lock:
            evicted, self._evicted = self._evicted, {}
        return list(evicted.values())

    def _evict_for(self, usage: Usage, incoming: int) -> None:
        """Unlink files in eviction order until ``incoming`` bytes fit in the folder's
        budget. Called with both locks held, so no write of the same digest, here or in
        another process, can slip in between. When evicting all this process knows of
        would not make the room, it lists the folder first: the rest of the total is other
        processes' records, or a count left too high."""
        # No valid total in the file (a ledger made again), or no tenant table where quotas need
        # one (made again, torn, or its total changed by an older kvplug): list the folder.
        rescanned = not usage.known or (usage.tenants is None and self._order.has_quotas and self._tenants_relist_due())
        # Past what evicting every record this process knows could free (another process's
        # records, or a count a crash or a hand left too high): list first, not after evicting all.
        rescanned = rescanned or usage.total - self._known_bytes() + incoming > self._budget
        if rescanned:
            self._rebuild(usage, self._list(usage))
        elif self._kept and usage.total + incoming > self._budget:
            # Before its own records: those left for engines that have ended since (a check
            # per such engine, not per record), else they would stay for as long as this
            # process has anything else to evict.
            dead = {owner for owner in self._kept.owners() if not self._marks.alive(owner)}
            if dead:
                self._release_kept(self._kept.kept_only_by(dead))
        while usage.total + incoming > self._budget:
            victims = self._order.pop_victims(1)
            if not victims:
                if self._release_kept():  # pins of other processes that ended since: evictable
                    continue
                # Nothing this process does not know of: the rest is pinned (here or by others).
                if rescanned or usage.total <= self._known_bytes():
                    break
                self._rebuild(usage, self._list(usage))
                rescanned = True
                continue
            self._remove_victims(usage, victims)

    def _known_bytes(self) -> int:
        """Value bytes of the folder's total that this process knows of: its order's, and the
        records it left for other processes' pins."""
        return self._order.value_bytes + self._kept.value_bytes

    def _release_kept(self, digests: list[str] | None = None) -> bool:
        """Ask again about the records left for other processes' pins (``digests``, or all):
        those no longer pinned anywhere go back into the order, the first to leave; whether
        any did (locks held)."""
        released = False
        for digest in self._kept.digests() if digests is None else digests:
            owners = self._marks.held_elsewhere(digest)
            if owners:
                self._kept.hold(digest, owners)  # (by the owners still alive)
                continue
            entry = self._kept.drop(digest)
            if entry is not None and digest not in self._order and self._value_size_on_disk(digest):
                self._order.add_cold(digest, entry)
                released = True
        return released

    def _tenants_relist_due(self) -> bool:
        """Whether a stale tenant table may be listed again: :data:`TENANT_RELIST_INTERVAL_S` and
        :data:`TENANT_RELIST_COST_FACTOR` times the last listing's time have passed since it."""
        interval = max(TENANT_RELIST_INTERVAL_S, TENANT_RELIST_COST_FACTOR * self._tenants_listing_s)
        return clock() - self._tenants_listed_at >= interval

    def _keep_folder_quota(self, usage: Usage, tenant: str, tag: bytes) -> None:
        """Evict ``tenant``'s records (unpinned, in its own order) until its bytes in the whole
        folder (the ledger's count of its tag, every process's records) fit its quota (locks held).
        Where the records this process does not know of fill the quota by themselves (other
        processes', or a count a crash left too high), the folder is listed first, once (their
        tags say whose they are; the count becomes the listing's): then the tenant's oldest
        records leave first, whoever wrote them, and this process does not evict all of its own
        records, the one just written included, for records it cannot see or that are not there."""
        rescanned = usage.tenants is None
        self._forget_kept_gone(usage, tenant, tag)
        while usage.tenants is not None and self._order.over_folder_quota(tenant, held := self._quota_held(usage, tag)):
            unseen = not rescanned and self._order.others_fill_quota(tenant, held)
            victim = None if unseen else self._order.take_victim_of(tenant)
            if victim is None:
                if rescanned:
                    break
                self._rebuild(usage, self._list(usage))
                rescanned = True
                continue
            self._remove_victims(usage, [victim])

    def _forget_kept_gone(self, usage: Usage, tenant: str, tag: bytes) -> None:
        """Forget ``tenant``'s records left for other processes' pins that a third process removed
        since (locks held), where the tenant's count with them is over its quota: gone, they no
        longer count in the folder, and taking their bytes off it would leave the tenant over its
        quota for as long as the pinning engine lives. (One stat per such record: few, and only
        while other engines' pins of the tenant stand beside a full quota.)"""
        if not self._kept or usage.tenants is None:
            return
        if self._order.over_folder_quota(tenant, usage.tenants.get(tag, 0)):
            for digest in self._kept.digests_of(tag):
                if not self._value_size_on_disk(digest):
                    self._kept.drop(digest)

    def _quota_held(self, usage: Usage, tag: bytes) -> int:
        """File bytes of the tenant tagged ``tag`` in the folder that count against its quota
        here: all but those left for other processes' pins (which count where they were made)."""
        held = 0 if usage.tenants is None else usage.tenants.get(tag, 0)
        return held - (self._kept.file_bytes_of(tag) if self._kept else 0)

    def _remove_victims(self, usage: Usage, victims: list[tuple[str, IndexEntry]]) -> int:
        """Unlink evicted records (locks held). One that cannot be removed is skipped from
        then on: out of the index and the total, so the budget is kept with the others. One
        another live process marked pinned stays, out of this process's order until a listing
        finds it again (:mod:`kvplug_disk.pin_marks`). How many were not kept so."""
        removed = 0
        for digest, entry in victims:
            owners = self._marks.held_elsewhere(digest)
            if owners:  # another live process pinned it: it stays
                self._kept.keep(
                    digest, entry, record_tag(self._folder, digest) if usage.tenants is not None else None, owners
                )
                self._counts["kept_pinned_elsewhere"] += 1
                continue
            removed += 1
            if self._unlink_record(usage, digest, "evict"):
                self._evicted[digest] = StoredRecord(digest, entry.file_size, 0.0)
        return removed

    def _unlink_record(self, usage: Usage, digest: str, op: str) -> bool:
        """Remove one record file and take its bytes off the folder's total (locks held)."""
        stat = None
        removed = False
        self._kept.drop(digest)
        tag = record_tag(self._folder, digest) if usage.tenants else None  # (its tenant's count goes too)
        try:
            stat = self._folder.stat(digest)
            if stat is None or not self._folder.unlink(digest):
                return False
            removed = True
        except OSError as exc:
            self._entry_failed(op, digest, exc, locked=True)
            if stat is None or not self._skipped(digest):
                return False
            # Skipped from now on: out of the budget too, since nothing can make it go.
        usage.total -= value_size_of(stat.st_size)
        usage.add_tenant(tag, -stat.st_size)
        if removed:
            self._marks.forget(digest)  # (stored again, it is marked again if still pinned)
        return removed

    def _value_size_on_disk(self, digest: str) -> int:
        try:
            stat = self._folder.stat(digest)
        except OSError:
            return 0
        return 0 if stat is None else value_size_of(stat.st_size)

    def _list(self, usage: Usage, clean_temps_older_than: float | None = None) -> ScanResult:
        """A listing of the folder for :meth:`_rebuild` (locks held): with the records' tenant tags
        where quotas apply or the folder keeps a tenant table (read as the listing goes)."""
        tags = self._order.has_quotas or usage.tenants is not None
        started = clock()
        scan = self._folder.scan(clean_temps_older_than=clean_temps_older_than, tags=tags)
        self._counts["folder_listings"] += 1
        if scan.tags is not None:
            self._tenants_listed_at = clock()
            self._tenants_listing_s = self._tenants_listed_at - started
        return scan

    def _rebuild(self, usage: Usage, scan: ScanResult) -> None:
        """Order every record of a folder listing (:meth:`_list`) as cold entries, the oldest (by
        mtime) the first to leave, the records pinned before still pinned; the folder's total
        becomes the listing's. A listing with the records' tags (quotas apply or the folder keeps
        a tenant table): the table becomes the listing's, and the tenants this process knows take their records."""
        records = scan.records
        records.sort(key=lambda record: record[2])
        records = [record for record in records if not self._skipped(record[0])]
        tags = None
        if scan.tags is not None:
            found = scan.tags
            tags = {digest: tag for digest, _, _ in records if (tag := found.get(digest)) is not None}
        pinned = self._order.pinned()  # the pin book's are pinned again as they enter; these may not be in it
        self._order = self._order.fresh()
        self._kept.clear()  # in the order again: asked about again when chosen to leave
        if tags:
            salts = {tenant_tag(salt): salt for salt in self._tenant_salts()}
            self._order.adopt_tenants({digest: salts[tag] for digest, tag in tags.items() if tag in salts})
        for digest, file_size, _ in reversed(records):  # each cold entry goes before the others
            self._order.add_cold(digest, IndexEntry(value_size_of(file_size), file_size))
        for digest in pinned:
            if digest in self._order:
                self._order.pin(digest)
        self._mark_new_pins(self._order.pinned())  # (the pin book's, found by this listing)
        self._unmark_if_due()
        usage.total = self._order.value_bytes
        usage.known = True
        usage.tenants = None if tags is None else {}
        for digest, file_size, _ in records:
            usage.add_tenant(tags.get(digest) if tags else None, file_size)

    def _folder_tenant_bytes(self, label: Callable[[str], str]) -> dict[str, int]:
        """The file bytes in the folder of each tenant this process knows, by ``label``
        (``None`` in the table: none kept; other processes' tenants are not named)."""
        tenants = self._ledger.peek_tenants() or {}
        figures: dict[str, int] = {}
        for salt in self._tenant_salts():
            held = tenants.get(tenant_tag(salt), 0)
            if held:
                figures[label(salt)] = figures.get(label(salt), 0) + held
        return figures
