"""The record tier base (kvplug.RecordTier) over a backend whose store is a dict in this
process: the conformance suite, and what the base owns (verification, the index bound,
the budget, the breaker) checked against the store's own contents."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

import pytest
from core_helpers import ComparingDictBackend

from kvplug import (
    RECORD_HEADER_SIZE,
    Buffer,
    CallSizes,
    RecordBackend,
    RecordTier,
    RecordTierConfig,
    StorageTier,
    StoredRecord,
    TierContext,
    key_digest,
)
from kvplug.errors import TierUnavailableError
from kvplug.testing import StorageTierContract

T = TypeVar("T")


class DictBackend(ComparingDictBackend):
    """Records in a dict that it can list, in small batches."""

    call_sizes = CallSizes(query=7, read=3, write=2, write_bytes=1 << 20)
    where = "dict store"

    async def listing(self) -> list[StoredRecord]:
        await self._enter()
        with self.lock:
            return [StoredRecord(n, len(v), float(i)) for i, (n, v) in enumerate(self.store.items())]


class DictTier(RecordTier):
    name = "dict"
    Config = RecordTierConfig
    store: dict[str, bytes]

    def open_backend(self, loop: asyncio.AbstractEventLoop) -> RecordBackend:
        self.backend = DictBackend(self.store)
        return self.backend


def make(store: dict[str, bytes], **options: object) -> DictTier:
    tier_class = type("DictTierOn", (DictTier,), {"store": store})
    config = RecordTierConfig.model_validate(
        {"request_timeout_s": 1.0, "retries": 0, "breaker_failures": 2, "breaker_cooldown_s": 60.0, **options}
    )
    return tier_class(config, TierContext(logger=logging.getLogger("test.record_tier")))


class TestDictRecordTier(StorageTierContract):
    lru = True

    @pytest.fixture
    def make_tier(self) -> Callable[..., StorageTier]:
        store: dict[str, bytes] = {}
        return lambda max_bytes: make(store, max_bytes=max_bytes)


def test_a_damaged_record_is_a_counted_miss_and_deleted() -> None:
    store: dict[str, bytes] = {}
    with make(store) as tier:
        tier.put([("v/f/a", b"x" * 1000), ("v/f/b", b"y" * 1000)])
        name = key_digest("v/f/a").hex()
        damaged = bytearray(store[name])
        damaged[RECORD_HEADER_SIZE + 10] ^= 1
        store[name] = bytes(damaged)
        assert tier.get(["v/f/a", "v/f/b"]) == [None, b"y" * 1000]
        assert name not in store
        assert tier.stats().extra["corrupt"] == 1


def test_a_damaged_record_a_read_removes_is_reported_removed_for_routers() -> None:
    """The engines told routers the chunk was stored in this tier (``stored``): its removal,
    or its being absent to this process, must be told too, as for records found gone."""
    store: dict[str, bytes] = {}
    with make(store) as tier:
        events: list[tuple[str, tuple[str, ...]]] = []
        tier.context.emit = lambda event: events.append((event.kind, event.keys))
        tier.put([("v/f/a", b"x" * 1000), ("v/f/b", b"y" * 1000)])
        name = key_digest("v/f/a").hex()
        store[name] = store[name][:-1] + bytes([store[name][-1] ^ 1])
        assert tier.get(["v/f/a", "v/f/b"]) == [None, b"y" * 1000]
        assert ("removed", ("v/f/a",)) in events, events


def test_a_record_under_another_key_is_never_returned() -> None:
    store: dict[str, bytes] = {}
    with make(store) as tier:
        tier.put([("v/f/a", b"a" * 100), ("v/f/b", b"b" * 100)])
        store[key_digest("v/f/b").hex()] = store[key_digest("v/f/a").hex()]
        assert tier.get(["v/f/b"]) == [None]


def test_the_index_bound_evicts_when_there_is_a_budget() -> None:
    store: dict[str, bytes] = {}
    with make(store, max_bytes=10_000, index_max_keys=3) as tier:
        tier.put([(f"v/f/{i}", bytes([i]) * 100) for i in range(5)])
        assert len(store) == 3 and tier.stats().items == 3
        assert tier.stats().evictions == 2


def test_the_index_bound_only_forgets_without_a_budget() -> None:
    store: dict[str, bytes] = {}
    with make(store, index_max_keys=3) as tier:
        tier.put([(f"v/f/{i}", bytes([i]) * 100) for i in range(5)])
        assert len(store) == 5 and tier.stats().items == 3
        assert tier.stats().extra["index_dropped_full"] == 2


def test_a_start_up_listing_fills_the_index_and_the_budget_applies_to_it() -> None:
    store: dict[str, bytes] = {}
    with make(store) as tier:
        tier.put([(f"v/f/{i}", bytes([i]) * 1000) for i in range(6)])
    with make(store, scan_on_start=True, max_bytes=3000) as tier:
        tier.flush()
        assert tier.stats().items == 3 and len(store) == 3
        assert tier.stats().bytes_used == 3000


def test_a_store_that_is_down_opens_the_breaker_then_costs_no_calls() -> None:
    store: dict[str, bytes] = {}
    with make(store) as tier:
        tier.put([("v/f/a", b"a" * 10)])
        tier.backend.down = True
        assert tier.get(["v/f/a"]) == [None]
        tier.put([("v/f/b", b"b")])
        assert tier.stats().extra["breaker_state"] == "open"
        calls = tier.backend.calls
        assert tier.contains(["v/f/a"]) == [False]
        tier.put([("v/f/c", b"c")])
        assert tier.backend.calls == calls
        assert tier.stats().extra["dropped_puts"] == 2


def test_a_name_the_store_fails_on_alone_is_a_miss_and_stays_indexed() -> None:
    """A primitive's exception in one name's slot: no answer for that name (a miss, a
    failed removal), nothing forgotten; the other names are answered, the breaker untouched."""
    store: dict[str, bytes] = {}
    with make(store) as tier:
        tier.put([("v/f/a", b"a" * 100), ("v/f/b", b"b" * 100)])
        failing = key_digest("v/f/a").hex()
        tier.backend.failing = {failing}
        assert tier.contains(["v/f/a", "v/f/b"]) == [False, True]
        assert tier.get(["v/f/a", "v/f/b"]) == [None, b"b" * 100]
        assert tier.stats().items == 2
        with pytest.raises(TierUnavailableError, match="failed"):
            tier.read_record(failing)
        removed: list[tuple[str, ...]] = []
        tier.context.emit = lambda event: removed.append(event.keys)
        with pytest.raises(TierUnavailableError, match="1 of 2 removals"):
            tier.remove(["v/f/a", "v/f/b"])
        assert removed == [("v/f/b",)] and failing in store and tier.stats().items == 1
        stats = tier.stats()
        assert stats.extra["breaker_state"] == "closed" and stats.extra["failures"] == 0
        tier.backend.failing = set()
        assert tier.get(["v/f/a"]) == [b"a" * 100]


def test_a_value_that_is_not_contiguous_is_refused_before_anything_is_stored() -> None:
    """Checked with the batch, not when its record is framed: framing is lazy, and the
    batches before it would already be in the store, neither indexed nor counted."""
    store: dict[str, bytes] = {}
    with make(store) as tier:
        strided = memoryview(bytes(range(200)))[::2]
        items: list[tuple[str, Buffer]] = [(f"v/f/{i}", bytes([i]) * 100) for i in range(4)]
        with pytest.raises(TypeError) as refused:
            tier.put([*items, ("v/f/strided", strided)])
        assert tier.contains([key for key, _ in items]) == [False] * 4  # (after any call in flight)
        assert store == {} and tier.stats().items == 0 and tier.stats().puts == 0
        assert "value for v/f/strided is not a C-contiguous buffer" in str(refused.value)
