"""The record tier base against backends that misbehave: answers of the wrong length or
in the wrong order, and a coroutine that blocks the tier's event loop. A backend's
mistake is a failure of the backend (a miss, counted towards its breaker), never a
reason to forget or delete the records it was asked about."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
from core_helpers import DictRecordBackend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplug import (
    Buffer,
    CallSizes,
    RecordBackend,
    RecordTier,
    RecordTierConfig,
    TierContext,
    key_digest,
)
from kvplug.core.records.frame import pack_record
from kvplug.core.remote.calls import call_budget

#: How a backend mangles the list it answers a read with.
Mangle = Callable[[list[Buffer | None]], list[Buffer | None]]


class MisbehavingBackend(DictRecordBackend):
    """Records in a dict; ``read`` answers what ``mangle`` makes of the right answer, and
    blocks the tier's loop (a blocking client call in a coroutine) while ``blocking`` is set."""

    call_sizes = CallSizes(read=64)
    where = "misbehaving store"

    def __init__(self, store: dict[str, bytes], mangle: Mangle) -> None:
        super().__init__(store)
        self.mangle = mangle
        self.reads = 0
        self.blocking = False
        self.release = threading.Event()

    async def read(self, names: Sequence[str], sizes: Sequence[int | None]) -> list[Buffer | None]:
        self.reads += 1
        if self.blocking:
            self.release.wait(60)  # blocks the loop: no await, no deadline can end it
        return self.mangle([self.store.get(n) for n in names])

    async def delete_if_same(self, names: Sequence[str], seen: Sequence[Buffer | None]) -> list[bool]:
        removed = []
        for name, data in zip(names, seen):
            same = data is not None and self.store.get(name) == bytes(data)
            if same:
                self.deletes.append(name)
            removed.append(same and self.store.pop(name, None) is not None)
        return removed


class MisbehavingTier(RecordTier):
    name = "misbehaving"
    backend: MisbehavingBackend
    store: dict[str, bytes]
    mangle: Mangle

    def open_backend(self, loop: asyncio.AbstractEventLoop) -> RecordBackend:
        self.backend = MisbehavingBackend(self.store, self.mangle)
        return self.backend


def make(store: dict[str, bytes], mangle: Mangle, **options: object) -> MisbehavingTier:
    tier_class = type("MisbehavingTierOn", (MisbehavingTier,), {"store": store, "mangle": staticmethod(mangle)})
    config = RecordTierConfig.model_validate(
        {"request_timeout_s": 1.0, "retries": 0, "breaker_failures": 3, "breaker_cooldown_s": 600.0, **options}
    )
    return tier_class(config, TierContext(logger=logging.getLogger("test.record_tier_answers")))


KEYS = [f"v/f/{i}" for i in range(6)]


def value(key: str) -> bytes:
    return key.encode() * 100


def stored_records() -> dict[str, bytes]:
    """Every key's record, as the tier writes it (the store the tests start from)."""
    return {key_digest(key).hex(): pack_record(key, value(key)) for key in KEYS}


def one_too_few(answer: list[Buffer | None]) -> list[Buffer | None]:
    return answer[1:]  # each answer one name early


def one_too_many(answer: list[Buffer | None]) -> list[Buffer | None]:
    return [answer[-1], *answer]  # each answer one name late


def two_swapped(answer: list[Buffer | None]) -> list[Buffer | None]:
    if len(answer) < 2:
        return answer
    return [answer[1], answer[0], *answer[2:]]


@pytest.fixture
def tiers() -> Iterator[list[MisbehavingTier]]:
    opened: list[MisbehavingTier] = []
    yield opened
    for tier in opened:
        tier.backend.release.set()
        tier.close()


@pytest.mark.parametrize("mangle", [one_too_few, one_too_many, two_swapped])
def test_a_backend_answering_the_wrong_records_deletes_nothing_and_opens_its_breaker(
    mangle: Mangle, tiers: list[MisbehavingTier]
) -> None:
    store = stored_records()
    tiers.append(tier := make(store, mangle, breaker_failures=3))
    answers = [tier.get(KEYS) for _ in range(3)]
    assert tier.backend.deletes == [] and store == stored_records()  # every record intact, still stored
    assert answers == [[None] * len(KEYS)] * 3  # a miss: the answer fits no name
    stats = tier.stats()
    assert stats.extra["corrupt"] == 0 and stats.extra["failures"] == 3
    assert stats.extra["breaker_state"] == "open"
    reads = tier.backend.reads
    assert tier.get(KEYS) == [None] * len(KEYS)
    assert tier.backend.reads == reads and tier.stats().extra["short_circuited"] == len(KEYS)  # fails fast


def test_a_record_the_store_really_holds_under_another_name_is_still_deleted(tiers: list[MisbehavingTier]) -> None:
    """The check reads a mismatched name again, alone: what the store itself holds under
    the wrong name is corrupt as before (a miss, counted, deleted), not the backend's fault."""
    store = stored_records()
    first, second = (key_digest(key).hex() for key in KEYS[:2])
    store[first] = store[second]  # another key's record under this name, in the store itself
    tiers.append(tier := make(store, lambda answer: answer))
    found = tier.get(KEYS)
    assert found[0] is None and all(bytes(v) == value(k) for k, v in zip(KEYS[1:], found[1:]) if v is not None)
    assert None not in found[1:]
    assert tier.backend.deletes == [first] and first not in store
    stats = tier.stats()
    assert stats.extra["corrupt"] == 1 and stats.extra["failures"] == 0 and stats.extra["breaker_state"] == "closed"


@st.composite
def mangles(draw: st.DrawFn) -> tuple[str, Mangle]:
    """A mangled answer for a read of every key: any permutation, truncation or extension."""
    count = len(KEYS)
    kind = draw(st.sampled_from(["permuted", "truncated", "extended"]))
    if kind == "permuted":
        order = draw(st.permutations(range(count)).filter(lambda o: list(o) != list(range(count))))
        return kind, lambda answer: [answer[i] for i in order] if len(answer) == count else answer
    if kind == "truncated":
        keep = draw(st.integers(0, count - 1))
        return kind, lambda answer: answer[:keep] if len(answer) == count else answer
    extra = draw(st.lists(st.sampled_from([None, *stored_records().values()]), min_size=1, max_size=3))
    at = draw(st.integers(0, count))
    return kind, lambda answer: [*answer[:at], *extra, *answer[at:]] if len(answer) == count else answer


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mangled=mangles())
def test_any_permutation_truncation_or_extension_of_a_read_deletes_nothing(mangled: tuple[str, Mangle]) -> None:
    _, mangle = mangled
    store = stored_records()
    with make(store, mangle, breaker_failures=100) as tier:
        found = tier.get(KEYS)
        assert tier.backend.deletes == [] and store == stored_records()
        assert found == [None] * len(KEYS)
        assert tier.contains(KEYS) == [True] * len(KEYS)  # nothing forgotten either
        assert tier.stats().extra["corrupt"] == 0 and tier.stats().extra["failures"] == 1


def test_a_backend_blocking_its_loop_opens_the_breaker_and_later_calls_fail_fast(
    tiers: list[MisbehavingTier],
) -> None:
    """Each call waits out its deadline and the backstop once; after breaker_failures of
    them the breaker is open, and calls cost nothing. The late answer of the call the
    loop was stuck in, once it comes, does not close the breaker."""
    store = stored_records()
    tiers.append(tier := make(store, lambda answer: answer, request_timeout_s=0.05, breaker_failures=2))
    tier.backend.blocking = True
    assert tier.get(KEYS[:1]) == [None]
    assert tier.get(KEYS[:1]) == [None]  # queued behind the stuck one: never reaches the backend
    assert tier.stats().extra["breaker_state"] == "open"
    assert tier.get(KEYS) == [None] * len(KEYS)
    assert tier.backend.reads == 1 and tier.stats().extra["short_circuited"] == len(KEYS)
    tier.backend.release.set()
    tier.close()  # after the stuck call has ended, and whatever it left queued
    assert tier.stats().extra["breaker_state"] == "open" and tier.backend.reads == 1
    assert store == stored_records() and tier.backend.deletes == []


def test_a_blocked_call_its_caller_stopped_waiting_for_counts_as_a_failure_not_a_success(
    tiers: list[MisbehavingTier],
) -> None:
    """A lookup under a budget stops waiting and misses; the call itself, finished late by
    the blocked loop, is a timed-out attempt (it opens a breaker of one failure)."""
    store = stored_records()
    tiers.append(tier := make(store, lambda answer: answer, request_timeout_s=0.05, breaker_failures=1))
    tier.backend.blocking = True
    with call_budget(0.01):
        assert tier.get(KEYS[:1]) == [None]
    time.sleep(0.5)  # the loop stays blocked well past the call's 0.05 s deadline
    tier.backend.release.set()
    deadline = time.monotonic() + 30  # the late call ends once the loop is free: a bound for a stalled machine
    while tier.stats().extra["failures"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = tier.stats()
    assert (stats.extra["breaker_state"], stats.extra["breaker_opens"], stats.extra["failures"]) == ("open", 1, 1)
    assert store == stored_records()
