"""Record backends that keep the budget themselves (``keeps_budget``) and run on the
caller's thread (``runs_inline``): the shape of a store several processes share under
one budget (the disk tier's folder, a shared-memory segment). Two tiers over one dict
play two processes."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import ClassVar

import pytest

from kvplug import (
    Buffer,
    KVEvent,
    RecordBackend,
    RecordTier,
    RecordTierConfig,
    RecordToWrite,
    StoredRecord,
    TierContext,
    key_digest,
)


class SharedStore:
    """Records in insertion order under one byte budget, whoever writes them."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.records: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.most_held = 0


class SharedBudgetBackend(RecordBackend):
    keeps_budget: ClassVar[bool] = True
    runs_inline: ClassVar[bool] = True
    where = "shared dict"

    def __init__(self, shared: SharedStore) -> None:
        self.shared = shared
        self.evicted: list[StoredRecord] = []
        self.threads: set[int] = set()
        self.flushes = 0
        self.failures = 0

    async def sizes(self, names: Sequence[str]) -> list[int | None]:
        self.threads.add(threading.get_ident())
        with self.shared.lock:
            return [len(self.shared.records[n]) if n in self.shared.records else None for n in names]

    async def read(self, names: Sequence[str], sizes: Sequence[int | None]) -> list[Buffer | None]:
        self.threads.add(threading.get_ident())
        with self.shared.lock:
            return [self.shared.records.get(n) for n in names]

    async def write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        self.threads.add(threading.get_ident())
        with self.shared.lock:
            held = self.shared.records
            for record in records:
                held.pop(record.name, None)
                while held and sum(map(len, held.values())) + record.size > self.shared.budget:
                    oldest = next(iter(held))
                    self.evicted.append(StoredRecord(oldest, len(held.pop(oldest)), 0.0))
                held[record.name] = record.joined()
                self.shared.most_held = max(self.shared.most_held, sum(map(len, held.values())))
        return [None] * len(records)

    async def delete(self, names: Sequence[str]) -> list[bool]:
        with self.shared.lock:
            return [self.shared.records.pop(n, None) is not None for n in names]

    async def flush(self) -> None:
        self.flushes += 1

    def take_evicted(self) -> list[StoredRecord]:
        with self.shared.lock:
            evicted, self.evicted = self.evicted, []
        return evicted

    def errors(self) -> int:
        return self.failures


class SharedTier(RecordTier):
    name = "shared"
    medium = "memory"
    shared: SharedStore

    def open_backend(self, loop: asyncio.AbstractEventLoop) -> RecordBackend:
        self.backend = SharedBudgetBackend(self.shared)
        return self.backend


def make(shared: SharedStore, events: list[KVEvent], **options: object) -> SharedTier:
    tier_class = type("SharedTierOn", (SharedTier,), {"shared": shared})
    config = RecordTierConfig.model_validate({"max_bytes": shared.budget, **options})
    return tier_class(config, TierContext(logger=logging.getLogger("test.traits"), emit=events.append))


def test_a_backend_keeping_one_budget_for_two_tiers_has_its_evictions_counted_and_reported() -> None:
    shared, events_a, events_b = SharedStore(budget=3 * 1064), [], []
    with make(shared, events_a) as a, make(shared, events_b) as b:
        a.put([(f"a/{i}", b"a" * 1000) for i in range(2)])
        b.put([(f"b/{i}", b"b" * 1000) for i in range(3)])  # evicts a's two records
        assert shared.most_held <= shared.budget and len(shared.records) == 3
        assert b.stats().evictions == 2 and [e.kind for e in events_b] == ["stored"]  # b never knew their keys
        assert a.get(["a/0", "a/1"]) == [None, None]  # a learns they are gone
        assert a.stats().items == 0 and a.stats().extra["index_found_gone"] == 2
        a.put([("a/2", b"a" * 1000)])  # evicts b/0: counted by a, whose index never knew its key
        assert a.stats().evictions == 1 and not [e for e in events_a if e.kind == "evicted"]
        assert b.get(["b/0"]) == [None] and b.stats().items == 2


def test_evictions_of_records_the_tier_wrote_emit_their_keys() -> None:
    shared, events = SharedStore(budget=2 * 1064), []
    with make(shared, events) as tier:
        tier.put([("k/0", b"0" * 1000), ("k/1", b"1" * 1000), ("k/2", b"2" * 1000)])
        assert [e.keys for e in events if e.kind == "evicted"] == [("k/0",)]
        assert tier.stats().evictions == 1 and tier.stats().items == 2
        assert tier.stats().bytes_used == 2000


def test_the_base_never_deletes_by_its_own_index_for_such_a_backend(caplog: pytest.LogCaptureFixture) -> None:
    shared, events = SharedStore(budget=10**6), []
    caplog.set_level(logging.WARNING)
    with make(shared, events, index_max_keys=2) as tier:
        tier.put([(f"k/{i}", b"x" * 100) for i in range(5)])
        assert len(shared.records) == 5  # the index forgot three; the store keeps them
        stats = tier.stats()
        assert (stats.items, stats.evictions, stats.extra["index_dropped_full"]) == (2, 0, 3)
        assert tier.get(["k/0"]) == [b"x" * 100]  # still served from the store
    assert not [r for r in caplog.records if "index of records is full" in r.getMessage()]


def test_an_inline_backend_runs_on_the_calling_thread_and_its_errors_and_flush_are_the_tiers() -> None:
    shared = SharedStore(budget=10**6)
    with make(shared, []) as tier:
        tier.put([("k", b"v")])
        assert tier.get(["k"]) == [b"v"] and tier.contains(["k", "other"]) == [True, False]
        assert tier.backend.threads == {threading.get_ident()}
        tier.backend.failures = 3
        assert tier.stats().errors == 3
        tier.flush()
        assert tier.backend.flushes == 1
        assert key_digest("k").hex() in shared.records


def test_an_inline_backend_whose_coroutine_suspends_is_refused() -> None:
    class Suspends(SharedBudgetBackend):
        async def read(self, names: Sequence[str], sizes: Sequence[int | None]) -> list[Buffer | None]:
            await asyncio.sleep(0)
            return [None] * len(names)

    class SuspendingTier(SharedTier):
        def open_backend(self, loop: asyncio.AbstractEventLoop) -> RecordBackend:
            return Suspends(self.shared)

    tier_class = type("SuspendingOn", (SuspendingTier,), {"shared": SharedStore(budget=10**6)})
    context = TierContext(logger=logging.getLogger("test.traits"))
    with (
        tier_class(RecordTierConfig(), context) as tier,
        pytest.raises(TypeError, match="runs_inline, but its coroutine suspended"),
    ):
        tier.get(["k"])
