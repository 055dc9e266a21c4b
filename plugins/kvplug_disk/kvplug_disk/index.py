"""The eviction order of tier ``disk``'s folder budget: record files, sizes, and a policy.

The disk backend keeps the ``max_bytes`` of the whole folder itself (see
:mod:`kvplug_disk.ledger`), so it needs the order of the files it may evict, which
the record tier's own index (keys, sizes for ``stats()``) does not give. That order is
the tier's ``eviction`` policy (:class:`kvplug.core.policies.eviction.EvictionPolicy`: ``lru`` or ``s3fifo``),
over file sizes (what an eviction frees). It is this process's own: rebuilt from the
folder at start, where every record enters cold, oldest mtime first to leave (writes
and hits set mtimes), kept up to date by this process's writes and reads, corrected
whenever the file system disagrees (a file another process wrote or evicted), and
rebuilt when evicting all of it would leave the folder over budget (keeping
its pins). Not thread-safe: the backend holds its lock around every call.

It holds this process's pinned records, so it is what says when their bytes change
(``on_pinned``, after any call that changed them): the one place the folder's pin figure
is written from (:mod:`kvplug_disk.pin_marks`), whichever path pinned, unpinned or dropped a
pinned record.

The policy is guarded (:class:`kvplug.GuardedEviction`): pinned records are never
victims, and a tenant over its quota gives up its own records
(:meth:`EvictionIndex.take_over_quota`). Both count file sizes. A rebuild keeps the
tenants learnt so far, and pins records the engine's pin book wants again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvplug import EvictionName, GuardedEviction, NameTenants, PinOutcome, SharedPins, Tenancy, TenancySettings


@dataclass(slots=True)
class IndexEntry:
    """One record file."""

    value_size: int
    file_size: int


class EvictionIndex:
    """Record digests in the order of an eviction policy, with exact byte totals."""

    def __init__(
        self,
        eviction: EvictionName = "lru",
        guard: Callable[[EvictionName], GuardedEviction] = GuardedEviction,
        on_pinned: Callable[[int], None] | None = None,
    ) -> None:
        self.eviction: EvictionName = eviction
        self._guard = guard
        self._entries: dict[str, IndexEntry] = {}
        # Holds exactly the digests of _entries, each with its file size.
        self._policy = guard(eviction)
        self.value_bytes = 0
        self.file_bytes = 0
        #: Told the pinned bytes after each call that changed them (the backend's lock held).
        self._on_pinned = on_pinned
        self._told = 0  # the pinned bytes last told

    def fresh(self) -> EvictionIndex:
        """An empty index of the same policy and guard, knowing the tenants this one learnt
        (and telling the same ``on_pinned``: its first change is told against this one's bytes)."""
        index = EvictionIndex(self.eviction, self._guard, self._on_pinned)
        index._policy.adopt_tenants(self._policy.tenants_of())
        index._told = self._told
        return index

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def get(self, digest: str) -> IndexEntry | None:
        return self._entries.get(digest)

    def add(self, digest: str, entry: IndexEntry) -> None:
        """Insert, or replace as a use of it (``lru``: now the most recently used)."""
        old = self._entries.get(digest)
        if old is not None:
            self.value_bytes -= old.value_size
            self.file_bytes -= old.file_size
        self._store(digest, entry)
        self._policy.inserted(digest, entry.file_size)  # (a record the pin book wants enters pinned)
        self._tell()

    def add_cold(self, digest: str, entry: IndexEntry) -> None:
        """Insert an entry known to be absent, found by a listing rather than stored: it
        goes before every entry held (start-up: add the newest first)."""
        self._store(digest, entry)
        self._policy.inserted(digest, entry.file_size, cold=True)
        self._tell()

    def touch(self, digest: str) -> None:
        """A hit on ``digest`` (ignored when not held)."""
        self._policy.accessed(digest)

    def pop(self, digest: str) -> IndexEntry | None:
        if digest not in self._entries:
            return None
        self._policy.removed(digest)
        entry = self._take(digest)
        self._tell()  # (a pinned record gone)
        return entry

    def _take(self, digest: str) -> IndexEntry:
        """Remove a held entry and its bytes (the caller tells the policy, or it chose it)."""
        entry = self._entries.pop(digest)
        self.value_bytes -= entry.value_size
        self.file_bytes -= entry.file_size
        return entry

    def pop_victims(self, file_bytes: int) -> list[tuple[str, IndexEntry]]:
        """Remove entries in eviction order until their files add up to ``file_bytes``."""
        victims = [(digest, self._take(digest)) for digest, _ in self._policy.victims(file_bytes)]
        self._tell()  # (never pinned ones: told all the same, a comparison)
        return victims

    def pin(self, digest: str) -> PinOutcome:
        """Take a held record out of eviction (within the guard's pin budget)."""
        outcome = self._policy.pin(digest)
        self._tell()
        return outcome

    def is_pinned(self, digest: str) -> bool:
        return self._policy.is_pinned(digest)

    @property
    def pinned_bytes(self) -> int:
        """File bytes of the pinned records (what the guard's pin budgets count)."""
        return self._policy.pinned_bytes

    def pinned(self) -> list[str]:
        """The pinned digests."""
        return [digest for digest in self._entries if self._policy.is_pinned(digest)]

    def unpin(self, digest: str) -> bool:
        """Make a pinned record evictable again; whether it was pinned."""
        unpinned = self._policy.unpin(digest) is not None
        self._tell()
        return unpinned

    def admits(self, digest: str, entry: IndexEntry, budget: int) -> bool:
        """Whether a record can be kept beside the pinned ones (``budget``: value bytes) and
        within its tenant's quota (file bytes), :meth:`kvplug.GuardedEviction.admits`: a
        refusal is counted and logged."""
        return self._policy.admits(digest, entry.file_size, budget, overhead=entry.file_size - entry.value_size)

    @property
    def has_quotas(self) -> bool:
        return bool(self._policy.quotas) or self._policy.default_quota is not None

    def adopt_tenants(self, tenants: dict[str, str]) -> None:
        """The tenants of records (by digest) learnt from the folder (before they are added)."""
        self._policy.adopt_tenants(tenants)

    def over_folder_quota(self, tenant: str, folder_bytes: int) -> bool:
        """Whether ``tenant``, holding ``folder_bytes`` file bytes in the folder, is over its
        quota there: its records this process pinned for the operator do not count."""
        quota = self._policy.quota_of(tenant)
        return quota is not None and folder_bytes - self._policy.operator_pinned_of(tenant) > quota

    def others_fill_quota(self, tenant: str, folder_bytes: int) -> bool:
        """Whether ``tenant``'s records this process does not know of (other processes', or a
        count left too high by a crash) fill its quota in the folder by themselves."""
        quota = self._policy.quota_of(tenant)
        return quota is not None and folder_bytes - self._policy.held_of(tenant) >= quota

    def take_victim_of(self, tenant: str) -> tuple[str, IndexEntry] | None:
        """Remove ``tenant``'s next unpinned record in its own order (for its quota)."""
        victim = self._policy.take_victim_of(tenant)
        taken = None if victim is None else (victim[0], self._take(victim[0]))
        self._tell()
        return taken

    def take_over_quota(self) -> list[tuple[str, IndexEntry]]:
        """Remove the records of tenants over their quotas (each its own, in its order)."""
        taken = [(digest, self._take(digest)) for digest, _ in self._policy.take_over_quota()]
        self._tell()
        return taken

    def stats_extra(self) -> dict[str, int]:
        """Pins, quota evictions and per-tenant figures (:meth:`kvplug.GuardedEviction.stats_extra`)."""
        return self._policy.stats_extra()

    def items(self) -> Iterator[tuple[str, IndexEntry]]:
        """Every entry (a copy, in no particular order)."""
        return iter(list(self._entries.items()))

    def _tell(self) -> None:
        """Tell ``on_pinned`` the pinned bytes, if they changed since it was last told (called by
        every method that changes the policy's keys or pins)."""
        pinned = self._policy.pinned_bytes
        if pinned != self._told:
            self._told = pinned
            if self._on_pinned is not None:
                self._on_pinned(pinned)

    def _store(self, digest: str, entry: IndexEntry) -> None:
        self._entries[digest] = entry
        self.value_bytes += entry.value_size
        self.file_bytes += entry.file_size


def record_guard(
    settings: TenancySettings,
    tenancy: Tenancy,
    names: NameTenants,
    logger: logging.Logger,
    where: str,
    shared_pins: SharedPins | None = None,
) -> Callable[[EvictionName], GuardedEviction]:
    """The guard of a record folder's index: ``settings``' pin budgets and quotas (over file
    sizes), the engine's wanted pins by record name, tenants by record name, and the bound of
    every process's pins in the folder (``shared_pins``)."""
    pins, labels = tenancy.pins, tenancy.labels
    quotas, default_quota = settings.quota_bytes()

    def guard(eviction: EvictionName) -> GuardedEviction:
        return GuardedEviction(
            eviction,
            pin_budget=settings.pin_budget(),
            quotas=labels.quota_salts(quotas),
            default_quota=default_quota,
            tenant_of=names.tenant_of,
            wants_pin=pins.wants_name,
            logger=logger,
            tier=where,
            request_pin_budget=settings.request_pin_budget(),
            requested_pin=pins.requested_name,
            labels=labels,
            shared_pins=shared_pins,
        )

    return guard
