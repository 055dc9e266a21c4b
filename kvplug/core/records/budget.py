"""The size index and the byte budget of a record tier (:class:`RecordBudget`, a base of
:class:`~kvplug.core.records.tier.RecordTier`): evictions by the index's LRU, evictions a
backend that keeps the budget reports, the round of checks on stores that evict on their
own, and the start-up listing."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import ClassVar, TypeVar

from kvplug.core.events import KVEvent, OrderedEvents
from kvplug.core.records.backend import RecordBackend
from kvplug.core.records.frame import RECORD_HEADER_SIZE
from kvplug.core.records.index import (
    RARE_LOSS_CHECKS_PER_NEW_KEY,
    RARE_LOSS_CHECKS_PER_ROUND,
    Entry,
    RecordIndex,
    Victim,
)
from kvplug.core.records.maintenance import LISTING_TIMEOUT_S
from kvplug.core.remote.calls import RemoteCalls
from kvplug.core.remote.retry import Absent
from kvplug.core.tier import TierContext

T = TypeVar("T")
A = TypeVar("A")
#: Evicted records remembered at most, for the puts racing their eviction (see ``_take_evicted``).
MAX_EVICTED_NOTES = 4096


class RecordBudget:
    """The index and budget methods of :class:`~kvplug.core.records.tier.RecordTier`, which
    sets the attributes below."""

    name: ClassVar[str]
    context: TierContext
    _backend: RecordBackend
    _calls: RemoteCalls
    _index: RecordIndex
    _where: str
    _warned_full: bool
    #: The tier's events, sent in the order they were queued (see :meth:`_report`).
    _events: OrderedEvents
    #: Held while a put indexes what it wrote and while evictions are taken (see RecordTier).
    _order: threading.Lock
    #: Evictions taken so far (a count), and the records a backend that keeps the budget
    #: evicted -> the count then, newest last, until a put of them (see :meth:`_take_evicted`).
    _evictions_taken: int
    _evicted_at: dict[str, int]

    def _count(self, name: str, amount: int = 1) -> None:
        raise NotImplementedError

    def _groups(
        self, operation: Callable[[Sequence[A]], Awaitable[Sequence[T]]], items: Sequence[A], size: int
    ) -> list[tuple[Sequence[A], Sequence[T] | BaseException]]:
        raise NotImplementedError

    def _report(self, event: KVEvent) -> None:
        """Queue ``event`` after the events of the changes before it, and send what is queued."""
        self._events.add(event)
        self._events.deliver()

    def _pushed_out(self, pushed: list[Victim]) -> None:
        """Entries a full index pushed out: evicted with ``max_bytes``, else forgotten (warned once)."""
        if not pushed:
            return
        if self._index.evicts_when_full:
            self._evict(pushed)
        elif not self._warned_full and not self._backend.keeps_budget:
            self._warned_full = True
            self.context.logger.warning(
                "tier %s: the index of records is full (index_max_keys=%d): the least recently used are "
                "forgotten, not deleted, and stay in %s until something else removes them "
                "(counted as index_dropped_full)",
                self.name,
                self._index.max_keys,
                self._where,
            )

    def _evict(self, victims: list[Victim]) -> None:
        """Delete records already removed from the index, counted and reported as evictions.

        A put of a victim may index it again (and queue its ``stored``) between the pick and
        the end of the delete, which runs under no lock: its write landed before the delete
        (deleted: gone) or after it (held). Only the store can tell, so it is asked after the
        delete (:meth:`_recheck_raced`); an ``evicted`` queued after that put's ``stored``
        for a record it holds would leave routers told it is gone for as long as it is held."""
        if not victims:
            return
        self._count("evictions", len(victims))
        names = [name for name, _ in victims]
        # A record whose delete fails stays in the store but leaves this budget; a later
        # listing (a restart) brings it back into the index.
        self._delete_quietly(names, forget=False)
        with self._order:  # a put indexes and queues its "stored" under it: its order with this "evicted"
            again = self._index.snapshot(names)
            known = tuple(key for (_, key), entry in zip(victims, again) if entry is None and key is not None)
            if known:  # queued after the "stored" of each: queued when it was indexed, before it could be a victim
                self._events.add(KVEvent("evicted", known, tier=self.name))
        self._events.deliver()
        raced = [(name, entry) for name, entry in zip(names, again) if entry is not None]
        if raced:
            self._recheck_raced(raced)

    def _recheck_raced(self, raced: list[tuple[str, Entry]]) -> None:
        """Victims a put indexed again during their eviction: reported evicted if the store no
        longer holds them (the delete came after that put's write), unless indexed again since.
        Without an answer they stay indexed: a lookup that misses reports them removed then."""
        if not self._calls.allow(len(raced)):
            return
        entries = dict(raced)
        gone: list[str] = []
        for group, result in self._groups(self._backend.exists, list(entries), self._backend.call_sizes.query):
            if isinstance(result, Absent):
                result = [False] * len(group)
            if not isinstance(result, BaseException):
                gone += [name for name, exists in zip(group, result) if exists is False]
        if not gone:
            return
        with self._order:
            keys = [self._index.forget_gone(name, entries[name]) for name in gone]
            known = tuple(key for key in keys if key is not None)
            if known:
                self._events.add(KVEvent("evicted", known, tier=self.name))
        self._events.deliver()

    def _take_evicted(self) -> None:
        """Count and report what a backend that keeps the budget itself removed.

        A record a racing put wrote and has not indexed yet may be among them: each is noted
        (:meth:`_evicted_since`), so that put neither indexes nor announces what is gone."""
        with self._order:
            gone = self._backend.take_evicted()
            if not gone:
                return
            self._evictions_taken += 1
            known: list[str] = []
            for record in gone:
                # Noted indexed or not: a racing put may be writing it again (then it indexed
                # the old record, whose eviction is reported here).
                self._evicted_at.pop(record.digest, None)
                self._evicted_at[record.digest] = self._evictions_taken
                key = self._index.forget(record.digest)
                if isinstance(key, str):
                    known.append(key)
            while len(self._evicted_at) > MAX_EVICTED_NOTES:  # the oldest: no put was writing them
                del self._evicted_at[next(iter(self._evicted_at))]
            if known:
                self._events.add(KVEvent("evicted", tuple(known), tier=self.name))
        self._count("evictions", len(gone))
        self._events.deliver()

    def _evicted_since(self, name: str, taken: int) -> bool:
        """Whether the record ``name`` was evicted after ``taken`` evictions were
        taken (a put's write began then): its put must not index it. Forgets the note either
        way: the put indexes or drops the record. Holds ``_order``."""
        at = self._evicted_at.pop(name, None)
        return at is not None and at > taken

    def _check_indexed(self) -> None:
        """Drop the indexed records the store no longer holds, among the next of the index's round."""
        # Bookkeeping only: never the breaker's half-open probe, never counted as short-circuited.
        if self._calls.breaker.state != "closed":
            return
        if self._backend.evicts_on_its_own:
            due = self._index.due_checks()
        else:  # checked for a budget kept by the index: records go only when another process deletes them
            due = self._index.due_checks(RARE_LOSS_CHECKS_PER_NEW_KEY, RARE_LOSS_CHECKS_PER_ROUND)
        gone: list[str | None] = []
        for group, result in self._groups(self._backend.exists, list(due), self._backend.call_sizes.query):
            if isinstance(result, Absent):  # a batch of one whose record is missing (an object store's 404)
                result = [False] * len(group)
            if not isinstance(result, BaseException):
                for name, exists in zip(group, result):
                    if exists is False:  # (an exception: no answer for this name)
                        gone.append(self._index.forget_gone(name, due[name]))
        self._report_gone(gone)

    def _report_gone(self, keys: Sequence[str | None]) -> None:
        """Report records found gone from the store (evicted by it, expired, or removed by
        another process) as ``removed``: a router told they were stored here would otherwise
        keep sending their prompts to this engine, whose lookups of them now miss."""
        known = tuple(key for key in keys if key is not None)
        if known:
            self._report(KVEvent("removed", known, tier=self.name))

    def _delete_quietly(self, names: list[str], *, forget: bool = True) -> None:
        if forget:
            for name in names:
                self._index.forget(name)
        if names and self._calls.allow(len(names)):
            self._groups(self._backend.delete, names, self._backend.call_sizes.query)

    async def _scan_into_index(self) -> None:
        try:
            found = await self._calls.policy.run(self._backend.listing, timeout_s=LISTING_TIMEOUT_S)
        except Exception as exc:
            self._index.abandon_scan()
            self.context.logger.warning("tier %s: could not list %s on start: %s", self.name, self._where, exc)
            return
        self._index.finish_scan(found, RECORD_HEADER_SIZE)
