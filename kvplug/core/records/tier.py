"""The record tier base: one implementation of what every store of framed records shares.

A :class:`RecordTier` subclass names itself, declares its ``Config`` and opens a
:class:`~kvplug.core.records.backend.RecordBackend`; everything else is here, once:

- values are stored as key-bound, checksummed records (:mod:`kvplug.core.records.frame`);
  every read is verified: a torn, swapped or damaged record is a miss, counted and
  deleted if the store still holds those bytes (else absent to this process until stored
  again; :meth:`~kvplug.core.records.backend.RecordBackend.delete_if_same`); a record of
  another format version (a newer kvplug in a shared store) is a miss, counted and kept;
  an answer that does not fit the call (a count off, a record in another name's place)
  fails it, counted towards the breaker: nothing is deleted on it;
- one bounded LRU index of record sizes (:class:`~kvplug.core.records.index.RecordIndex`),
  filled by a start-up listing where the backend can list, drives ``stats()`` and the
  ``max_bytes`` budget (least recently used records are deleted, reported as
  ``evicted`` events); a value larger than the budget is refused
  (:class:`~kvplug.errors.ValueTooLargeError`);
- every store call runs under :class:`~kvplug.core.remote.calls.RemoteCalls`: a deadline per
  attempt, bounded retries, a circuit breaker (lookups miss and stores are dropped,
  counted and warned about once a minute, while it is open);
- ``kvplug store`` maintenance (:class:`~kvplug.core.records.store.RecordStore`).

The index and budget upkeep is :mod:`kvplug.core.records.budget`'s, removals
:mod:`kvplug.core.records.removals`'.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, ClassVar, TypeVar

from kvplug.core.events import KVEvent, OrderedEvents
from kvplug.core.records.backend import SIZE_UNKNOWN, RecordBackend, RecordToWrite
from kvplug.core.records.budget import RecordBudget
from kvplug.core.records.calls import answering_each, checked_reads, framed_batches, one_each, run_batch
from kvplug.core.records.frame import RECORD_HEADER_SIZE, key_digest, unpack_record
from kvplug.core.records.index import RecordIndex, Victim
from kvplug.core.records.maintenance import LISTING_TIMEOUT_S
from kvplug.core.records.removals import RecordRemovals
from kvplug.core.remote.calls import RecordTierConfig, RemoteCalls
from kvplug.core.remote.retry import Absent, FailureKind
from kvplug.core.tier import Buffer, Medium, StorageTier, TierContext, TierStats
from kvplug.errors import (
    BackendAnswerError,
    CorruptChunkError,
    IncompatibleChunkError,
    TierClosedError,
    TierError,
    TierUnavailableError,
    ValueTooLargeError,
)

T = TypeVar("T")
A = TypeVar("A")
_COUNTERS = ("hits", "misses", "puts", "evictions", "dropped_puts", "corrupt", "incompatible")


class RecordTier(RecordBudget, RecordRemovals, StorageTier):
    """A storage tier of framed records in a store a :class:`RecordBackend` speaks.

    Subclasses set ``name``, ``Config`` (a :class:`RecordTierConfig` subclass) and
    implement :meth:`open_backend`; see the module docstring for what they inherit."""

    medium: ClassVar[Medium] = "remote"
    Config: ClassVar[type[RecordTierConfig]] = RecordTierConfig
    verified_reads = True  # get() returns only values whose record checksum (or MAC) matched
    reports_stored = True  # put() reports only the records written (not the refused or failed ones)

    def __init__(self, config: RecordTierConfig, context: TierContext) -> None:
        super().__init__(config, context)
        self.config: RecordTierConfig = config
        self._calls = RemoteCalls(self.name, config, context, classify=self._classify)
        try:
            self._backend = self.open_backend(self._calls.loop.loop)
        except Exception as exc:
            self._calls.close()
            raise TierError(f"tier {self.name!r} cannot open its store: {type(exc).__name__}: {exc}") from exc
        self._where = self._calls.where = self._backend.where or self.name
        # A backend that keeps the budget itself evicts; this index then only forgets.
        self._budget = None if config.max_bytes is None or self._backend.keeps_budget else int(config.max_bytes)
        self._index = RecordIndex(
            config.index_max_keys, evicts_when_full=self._budget is not None, eviction=config.eviction
        )
        self._lock = threading.Lock()
        # Held while a put indexes what it wrote and queues its "stored", and while an eviction
        # picks its victims: a record's "stored" is queued before any eviction of it can be.
        self._order = threading.Lock()
        # Through the context as it is when sent (a test may replace its emit).
        self._events = OrderedEvents(lambda event: self.context.emit(event))
        self._evictions_taken = 0
        self._evicted_at: dict[str, int] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._warned_full = False
        self._closed = False
        #: Names of corrupt records left in the store (no delete_if_same, or it failed), oldest first.
        self._suspects: dict[str, None] = {}
        try:  # connect now so the first lookup is fast; a store that is down is retried later
            self._calls.run(self._backend.open, timeout_s=self._backend.open_timeout_s)
        except (TierUnavailableError, Absent) as exc:
            context.logger.warning("tier %s: cannot reach %s yet (%s); will retry", self.name, self._where, exc)
        self._scan: Any = None
        if config.scan_on_start and self._backend.can_list:
            self._index.begin_scan()
            self._scan = self._calls.submit(self._scan_into_index())

    def open_backend(self, loop: asyncio.AbstractEventLoop) -> RecordBackend:
        """The backend for ``self.config``. ``loop`` is the tier's event loop, on which
        every primitive runs (for clients that bind to one). Raise to refuse the config."""
        raise NotImplementedError(f"{type(self).__name__} must implement open_backend")

    # --- reads ----------------------------------------------------------------------

    def contains(self, keys: Sequence[str]) -> list[bool]:
        self._check_open()
        if not keys:
            return []
        if not self._calls.allow(len(keys)):
            return [False] * len(keys)
        names = [key_digest(key).hex() for key in keys]
        seen = self._index.snapshot(names)
        answers: list[bool] = []
        gone: list[str | None] = []
        for group, result in self._groups(self._backend.sizes, names, self._backend.call_sizes.query):
            if isinstance(result, Absent):
                result = [None] * len(group)
            if isinstance(result, BaseException):  # no answer: a miss, but nothing is known to be gone
                answers.extend([False] * len(group))
                continue
            for name, size in zip(group, result):
                if isinstance(size, BaseException):  # no answer for this name alone
                    answers.append(False)
                    continue
                if size is None:  # evicted or removed by another process
                    gone.append(self._index.forget_gone(name, seen[len(answers)]))
                answers.append(size is not None and (size == SIZE_UNKNOWN or size >= RECORD_HEADER_SIZE))
        self._report_gone(gone)
        if self._suspects:  # found corrupt and still there: absent, so that the engine stores them again
            answers = [found and name not in self._suspects for name, found in zip(names, answers)]
        return answers

    def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        self._check_open()
        if not keys:
            return []
        if not self._calls.allow(len(keys)):
            self._count("misses", len(keys))
            return [None] * len(keys)
        names = [key_digest(key).hex() for key in keys]
        seen = self._index.snapshot(names)
        hints = [None if entry is None else entry[0] + RECORD_HEADER_SIZE for entry in seen]
        pairs = list(zip(names, hints))
        stored: list[Buffer | BaseException | None] = []
        for group, result in self._groups(checked_reads(self._backend), pairs, self._backend.call_sizes.read):
            if isinstance(result, Absent):
                result = [None] * len(group)
            stored.extend([result] * len(group) if isinstance(result, BaseException) else result)
        values: list[Buffer | None] = []
        corrupt: list[tuple[str, Buffer | None]] = []  # (name, what was read: None when found bad unread)
        pushed: list[Victim] = []
        gone: list[str | None] = []
        for key, name, data, entry in zip(keys, names, stored, seen):
            value = None
            if data is None:  # evicted or removed by another process
                gone.append(self._index.forget_gone(name, entry))
            elif not isinstance(data, BaseException) or isinstance(data, CorruptChunkError):
                try:  # (another exception: the store did not answer; this one: a record found bad unread)
                    if isinstance(data, CorruptChunkError):
                        raise data
                    value = self.unpack(data, key)
                except IncompatibleChunkError:
                    self._count("incompatible")  # possibly a newer kvplug's record in a shared store: keep it
                except CorruptChunkError as exc:
                    self.context.logger.warning(
                        "tier %s: corrupt record for %s (%s); removing it unless stored again since",
                        self.name,
                        key,
                        exc,
                    )
                    self._count("corrupt")
                    corrupt.append((name, None if isinstance(data, BaseException) else data))
                    gone.append(None if entry is None else key)  # removed, or absent to this process
            if value is None:
                self._count("misses")
            else:
                self._count("hits")
                self._unsuspect(name)
                pushed += self._index.record(name, value.nbytes, key)
            values.append(value)
        self._report_gone(gone)
        if corrupt:
            self._drop_corrupt(corrupt)
        self._pushed_out(pushed)
        return values

    def unpack(self, data: Buffer, key: str) -> memoryview:
        """The value of a record read for ``key``, checked (:func:`kvplug.unpack_record`);
        raises ``CorruptChunkError`` or ``IncompatibleChunkError``."""
        return unpack_record(data, key)

    # --- writes ---------------------------------------------------------------------

    def put(self, items: Sequence[tuple[str, Buffer]]) -> None:
        self._check_open()
        latest = dict(items)  # the same key twice in a batch: the last value wins
        budget = None if self.config.max_bytes is None else int(self.config.max_bytes)
        for key, value in latest.items():
            if not isinstance(key, str):  # before anything is stored: the whole batch is refused
                raise TypeError(f"tier keys are str, got {type(key).__name__}")
            view = memoryview(value)
            if not view.c_contiguous:  # framing casts it to bytes, after earlier records were sent
                raise TypeError(f"value for {key} is not a C-contiguous buffer")
            size = view.nbytes
            if budget is not None and size > budget:
                raise ValueTooLargeError(
                    f"value of {size} bytes for {key} exceeds the {self.name} tier's max_bytes {budget}"
                )
        if not latest:
            return
        if not self._calls.allow(len(latest)):
            self._count("dropped_puts", len(latest))
            return
        keys = list(latest)
        groups: list[list[tuple[str, RecordToWrite]]] = []
        taken = self._evictions_taken  # before the writes: an eviction taken later may be of them
        results = self._batch(self._write_group, framed_batches(keys, latest, self._backend.call_sizes, groups))
        failed = False
        pushed: list[Victim] = []
        written: list[str] = []
        with self._order:
            for group, result in zip(groups, results):
                if isinstance(result, Absent):  # the bucket or folder is gone: a failure for a write
                    result = TierUnavailableError(f"{self._where} does not exist")
                outcomes = [result] * len(group) if isinstance(result, BaseException) else result
                failed |= isinstance(result, BaseException)
                for (key, record), outcome in zip(group, outcomes):
                    if outcome is not None:  # not stored: whatever was there before is stale or gone
                        self._index.forget(record.name)
                        self._count("dropped_puts")
                        self._calls.dropped(outcome)
                        continue
                    self._count("puts")
                    # Evicted by a racing put once written: not held, so not indexed. (Or just before
                    # this write landed: then held, unannounced; never announced and gone.)
                    if not self._evicted_since(record.name, taken):
                        self._unsuspect(record.name)
                        pushed += self._index.record(record.name, record.value.nbytes, key)
                        written.append(key)
            if written:  # before the evictions of them, this put's or a racing one's: a router hears "stored" first
                self._events.add(KVEvent("stored", tuple(written), tier=self.name))
        self._events.deliver()
        self._pushed_out(pushed)
        # Records gone from the store behind this process's back (the server's own eviction,
        # another engine's removal, an S3 lifecycle rule) stay indexed until checked: a budget
        # kept by the index would evict good records to free room that is already free, so the
        # round of checks runs before the budget is applied. After a failed batch the store is
        # likely down or hung: a check would pay the write's worst case again before the
        # breaker opens.
        if (self._backend.evicts_on_its_own or self._budget is not None) and not failed:
            self._check_indexed()
        self._evict_over_budget()
        self._take_evicted()

    async def _write_group(self, group: Sequence[tuple[str, RecordToWrite]]) -> Sequence[BaseException | None]:
        return one_each(group, await self._backend.write([record for _, record in group]), "write")

    def stored_unsent(self, keys: Sequence[str]) -> list[bool]:
        return self._events.stored_unsent(keys)

    def flush(self) -> None:
        """Wait for the start-up listing to be indexed (budget applied); run the backend's ``flush``."""
        self._check_open()
        if type(self._backend).flush is not RecordBackend.flush:
            self._calls.run(self._backend.flush)
        self._take_evicted()
        scan, self._scan = self._scan, None
        if scan is None:
            return
        try:
            scan.result(LISTING_TIMEOUT_S * 2)
        except Exception as exc:
            self.context.logger.debug("tier %s: start-up listing did not finish: %s", self.name, exc)
        self._evict_over_budget()

    def _evict_over_budget(self) -> None:
        if self._budget is not None:
            with self._order:  # after the "stored" of every record it may pick
                victims = self._index.evict_over(self._budget)
            self._evict(victims)

    # --- counters and lifecycle -----------------------------------------------------

    def stats(self) -> TierStats:
        self._take_evicted()
        with self._lock:
            counters = dict(self._counters)
        extra: dict[str, int | float | str] = {
            "max_bytes": -1 if self.config.max_bytes is None else int(self.config.max_bytes),
            "index_max_keys": self._index.max_keys,
            "index_dropped_full": self._index.dropped_full,
            "index_found_gone": self._index.found_gone,
            "breaker_state": self._calls.breaker.state,
            "breaker_opens": self._calls.breaker.opens,
            "dropped_puts": counters["dropped_puts"],
            "refused_puts": self._calls.refused_writes,  # of the dropped: refused for want of permission
            "short_circuited": self._calls.short_circuited,
            "failures": self._calls.failed,
            "retries": self._calls.retried,
            "corrupt": counters["corrupt"],
            "incompatible": counters["incompatible"],
        }
        if self._backend.evicts_on_its_own:
            extra["items_are"] = "estimate"  # the store evicts without telling: the index's figures
        extra.update(self._backend.describe())
        return TierStats(
            bytes_used=self._index.bytes_used,
            items=self._index.items,
            hits=counters["hits"],
            misses=counters["misses"],
            puts=counters["puts"],
            evictions=counters["evictions"],
            errors=self._calls.failed + counters["corrupt"] + self._backend.errors(),
            extra=extra,
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._calls.close(final=self._backend.close())
        self._index.clear()

    def _classify(self, exc: BaseException) -> FailureKind:
        return "permanent" if isinstance(exc, BackendAnswerError) else self._backend.classify(exc)

    def _groups(
        self, operation: Callable[[Sequence[A]], Awaitable[Sequence[T]]], items: Sequence[A], size: int
    ) -> list[tuple[Sequence[A], Sequence[T] | BaseException]]:
        """Run ``operation`` on slices of ``size`` items; (slice, its answer, one per item, or an exception)."""
        groups = [items[i : i + size] for i in range(0, len(items), max(size, 1))]
        return list(zip(groups, self._batch(answering_each(operation), groups)))

    def _batch(self, operation: Callable[[A], Awaitable[T]], arguments: Iterable[A]) -> list[T | BaseException]:
        try:
            return run_batch(self._backend, self._calls, operation, arguments)
        except TierClosedError:
            raise TierClosedError(f"tier {self.name!r} ({self._where}) was closed during the operation") from None

    def _unsuspect(self, name: str) -> None:
        """A record stored or read whole again: no longer taken for the corrupt one."""
        if self._suspects:
            with self._lock:
                self._suspects.pop(name, None)

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counters[name] += amount

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"tier {self.name!r} ({self._where}) is closed")
