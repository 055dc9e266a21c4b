"""The pins of tier ``disk``'s backend (:class:`~kvplug_disk.backend.DiskBackend`): records taken
out of this process's eviction order, and marked pinned in the folder so that no other process
sharing it evicts them either (:mod:`kvplug_disk.pin_marks`)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvplug import PinOutcome, StoredRecord
from kvplug_disk.index import EvictionIndex, IndexEntry
from kvplug_disk.ledger import FolderLockTimeoutError, Usage, UsageLedger
from kvplug_disk.pin_marks import PinMarks
from kvplug_disk.problems import ProblemLog


class FolderPins:
    """The pin methods of :class:`~kvplug_disk.backend.DiskBackend`, which sets the attributes below.

    Whatever pins a record in this process's order marks it (:meth:`_mark_new_pins`): a pin, a
    store or a lookup of a record the engine's pin book wants, a listing that finds one. A pin
    this process gave up (an unpin; a request's pin an operator's pin turned back into an
    ordinary chunk, or a pinned record stored again past the pin budget, both unmarked at the
    next pin or unpin) loses its mark, under the folder's lock only (an unpin that could not take
    it leaves the mark to the next pin, unpin, store or listing)."""

    _lock: threading.Lock
    _ledger: UsageLedger
    _lock_wait_s: float
    _order: EvictionIndex
    _problems: ProblemLog
    _marks: PinMarks
    #: An unpin (or pin) gave up waiting for the folder's lock: marks of records this process no
    #: longer pins wait for the next time it holds it (never removed without it, see unpin).
    _unmark_due = False
    #: The other processes' pinned bytes, read once for a whole pin call (:meth:`_others_pinned`).
    _others_read: int | None = None

    if TYPE_CHECKING:

        def _sizes(self, names: Sequence[str]) -> list[int | None]: ...

        def _remove_victims(self, usage: Usage, victims: list[tuple[str, IndexEntry]]) -> int: ...

        def take_evicted(self) -> list[StoredRecord]: ...

    def pin(self, names: Sequence[str]) -> list[tuple[PinOutcome, int]]:
        """Take records out of eviction (each asked of the file system first, so a record
        another process wrote is pinned too): per name, what happened and its value bytes.
        Each is pinned and marked under the folder's lock, which every eviction takes (a record
        another process is evicting is either gone first or kept) and every process's pin
        takes too: the folder's pins stay within ``folder_pin_max_bytes`` however many pin at
        once (this process's pinned bytes are written for the others before the lock goes:
        :meth:`_pinned_changed`)."""
        self._sizes(names)
        try:
            with self._ledger.locked(timeout_s=self._lock_wait_s, then="pinned in this process only for now"):
                outcomes = self._pin_in_order(names)
                self._sync_marks(names)
        except FolderLockTimeoutError as exc:  # marked at the next pin, store or listing that finds them
            outcomes = self._pin_in_order(names)  # (within the other processes' pins as last written)
            with self._lock:
                self._unmark_due = True  # (and the marks of records unpinned since: see unpin)
            self._problems.error("pin", "the folder", exc)
        return outcomes

    def _pin_in_order(self, names: Sequence[str]) -> list[tuple[PinOutcome, int]]:
        """Pin ``names`` in this process's order, the other processes' pinned bytes read once."""
        others = self._marks.figures(others_only=True).pinned_bytes
        outcomes: list[tuple[PinOutcome, int]] = []
        with self._lock:
            self._others_read = others
            try:
                for digest in names:
                    entry = self._order.get(digest)
                    outcomes.append((self._order.pin(digest), 0 if entry is None else entry.value_size))
            finally:
                self._others_read = None
        return outcomes

    def _others_pinned(self) -> int:
        """The bytes the folder's other live owners pin (:class:`kvplug.SharedPins`' ``others``;
        the backend's lock held): read from their lock files, or once for a whole pin call."""
        if self._others_read is not None:
            return self._others_read
        return self._marks.figures(others_only=True).pinned_bytes

    def _pinned_changed(self, pinned: int) -> None:
        """The eviction order's pinned bytes changed to ``pinned`` (its ``on_pinned``; the
        backend's lock held, so a figure read before a change is never written after it): the
        one place this process's figure is written from, whatever pinned, unpinned or dropped a
        pinned record. Under the folder's lock, once, as it is released (:meth:`_write_figure`).
        Without it, at once: after pinned records left the order (found corrupt, gone, skipped),
        whose bytes would otherwise refuse the other engines' pins while this one lives (a
        figure that falls passes no bound); after a pin or unpin that could not take the lock,
        whose bytes the others must count at once (a pin's were decided without them already);
        after a lookup found a record the pin book wants. But never the lock file made, which is
        made under the folder's lock only: the first pin of an owner that cannot take it is
        counted at its next hold (:meth:`_write_figure` again)."""
        if not self._ledger.held_here():
            self._marks.publish(pinned, make=False)

    def _write_figure(self) -> None:
        """Write this process's pinned bytes as the folder's lock is released (the ledger's
        ``before_release``; the backend's lock not held): a no-op when the file holds them."""
        with self._lock:
            self._marks.publish(self._order.pinned_bytes)

    def unpin(self, names: Sequence[str]) -> list[int | None]:
        """Make records evictable again: per name its value bytes, ``None`` if not pinned. They
        count against their tenant's quota again: a tenant over it gives up its own records."""
        with self._lock:
            sizes: list[int | None] = []
            for digest in names:
                entry = self._order.get(digest)
                sizes.append(entry.value_size if entry is not None and self._order.unpin(digest) else None)
        try:
            with self._ledger.locked(
                timeout_s=self._lock_wait_s, then="tenants over their quotas give up records at the next write"
            ) as usage:
                # Under the folder's lock, as another engine's store copies the old file's marks
                # onto the new one it renames over it: a mark removed between the two would be
                # copied, and hold the record for every other engine while this one lives.
                self._sync_marks(())
                with self._lock:
                    over_quota = self._order.take_over_quota()
                    if over_quota:
                        self._remove_victims(usage, over_quota)
                        usage.save()
        except FolderLockTimeoutError as exc:  # unpinned all the same: the next write keeps the quota
            # The marks stay until the lock is held (the next pin, unpin, store or listing): one
            # removed without it may be copied first onto the file a store renames over the record.
            with self._lock:
                self._unmark_due = True
            self._problems.error("unpin", "the folder", exc)
        return sizes

    def _sync_marks(self, names: Iterable[str]) -> None:
        """Mark ``names`` where this process pinned them; unmark what it no longer pins (the
        folder's lock held)."""
        with self._lock:
            stale = self._marks.marked - set(self._order.pinned())
            new = [digest for digest in names if self._order.is_pinned(digest)]
            self._unmark_due = False
        self._marks.unmark(stale)
        for digest in new:
            self._marks.mark(digest)

    def _unmark_if_due(self) -> None:
        """Remove the marks an unpin (or pin) could not remove for want of the folder's lock
        (both locks held: a store or a listing)."""
        if self._unmark_due:
            self._unmark_due = False
            self._marks.unmark(self._marks.marked - set(self._order.pinned()))

    def _mark_entered(self, names: list[str]) -> None:
        """Mark the records of ``names`` that a lookup or read found and this process pins (they
        entered its order pinned: the engine's pin book wants them). Under the folder's lock,
        as every mark: an eviction, or another engine's store of the record copying the old
        file's marks onto the new one it renames over it, could otherwise come in between and
        drop the mark while this process takes it as set. Rare (a pinned record first found),
        so a lookup takes the lock only then."""
        with self._lock:
            pinned = [digest for digest in names if self._order.is_pinned(digest)]
        if not pinned or self._marks.read_only:
            return
        try:
            with (
                self._ledger.locked(timeout_s=self._lock_wait_s, then="marked at the next pin, store or listing"),
                self._lock,
            ):
                self._mark_new_pins(pinned)
        except FolderLockTimeoutError as exc:
            self._problems.error("pin", "the folder", exc)

    def _mark_new_pins(self, names: Iterable[str]) -> None:
        """Mark the records of ``names`` that this process pins (both locks held). Marked again
        even where this process marked them before: the file may be a new one without its mark
        (the record was removed by another process, then stored again)."""
        for digest in names:
            if self._order.is_pinned(digest):
                self._marks.mark(digest)


class KeptForOthers:
    """The records this process's evictions left in place for other processes' pins: out of its
    eviction order, yet in the folder's total (and their tenants' counts), so it must not list
    the folder to look for those bytes, nor count them against a tenant's quota here (another
    process's pins count where they were made, as this process's own do). Not thread-safe:
    the backend's lock is held. A listing forgets them: they enter the order again, and are
    asked about again when they are next chosen to leave."""

    def __init__(self) -> None:
        self._records: dict[str, _Kept] = {}
        #: Value bytes of the records (the budget counts value bytes).
        self.value_bytes = 0

    def __bool__(self) -> bool:
        return bool(self._records)

    def keep(self, digest: str, entry: IndexEntry, tag: bytes | None, owners: list[str]) -> None:
        """Remember ``digest``, left in place for the marks of the live ``owners``."""
        self.drop(digest)
        self._records[digest] = _Kept(entry, tag, owners)
        self.value_bytes += entry.value_size

    def drop(self, digest: str) -> IndexEntry | None:
        """Forget ``digest`` (back in the order, or gone); its entry, if it was kept."""
        kept = self._records.pop(digest, None)
        if kept is None:
            return None
        self.value_bytes -= kept.entry.value_size
        return kept.entry

    def hold(self, digest: str, owners: list[str]) -> None:
        """The live ``owners`` keep the kept record ``digest`` now."""
        kept = self._records.get(digest)
        if kept is not None:
            kept.owners = owners

    def owners(self) -> set[str]:
        """The owners whose marks kept records here: few (one per other engine pinning)."""
        return {owner for kept in self._records.values() for owner in kept.owners}

    def kept_only_by(self, dead: set[str]) -> list[str]:
        """The records whose every keeping owner is in ``dead``."""
        return [digest for digest, kept in self._records.items() if dead.issuperset(kept.owners)]

    def file_bytes_of(self, tag: bytes) -> int:
        """File bytes kept of the tenant tagged ``tag`` (quotas count file bytes)."""
        return sum(kept.entry.file_size for kept in self._records.values() if kept.tag == tag)

    def digests_of(self, tag: bytes) -> list[str]:
        """The records kept of the tenant tagged ``tag``."""
        return [digest for digest, kept in self._records.items() if kept.tag == tag]

    def digests(self) -> list[str]:
        return list(self._records)

    def clear(self) -> None:
        self._records.clear()
        self.value_bytes = 0


@dataclass
class _Kept:
    """A record :class:`KeptForOthers` holds: its entry, its tenant's tag, and the owners whose
    marks kept it."""

    entry: IndexEntry
    tag: bytes | None
    owners: list[str]
