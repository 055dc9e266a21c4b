"""Background lookups (``background_lookups``): the pool's bookkeeping, and the scheduler
side over a real CacheEngine with a memory tier and slower ones (test_tier_media.py's).

No engine: vLLM's request objects are plain data, as in test_tier_media.py; the engine
test is test_background_lookups.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_tier_media import (  # noqa: F401  (engine_and_control, engine, registry: fixtures)
    BLOCKS,
    PROMPT,
    answer,
    engine,
    engine_and_control,
    hit_figures,
    registry,
    request,
    scheduler,
    tier,
)

from kvplug import CacheEngine, RequestInfo
from kvplug_vllm.lookup_pool import LookupPool, Tiers
from kvplug_vllm.scheduler import SchedulerSide
from kvplug_vllm.settings import ConnectorSettings

__all__ = ["engine", "registry"]  # fixtures


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def gated(result: Tiers) -> tuple[threading.Event, threading.Event, Callable[[], Tiers]]:
    """A lookup that signals it started and answers ``result`` once released."""
    started, release = threading.Event(), threading.Event()

    def lookup() -> Tiers:
        started.set()
        assert release.wait(10)
        return result

    return started, release, lookup


def settle(pool: LookupPool, in_flight: int) -> None:
    deadline = time.monotonic() + 10
    while pool.in_flight != in_flight and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pool.in_flight == in_flight


@pytest.fixture
def pool() -> Iterator[LookupPool]:
    pool = LookupPool(2, timeout_s=5.0, clock=Clock())
    yield pool
    pool.close()


def test_a_lookup_is_answered_on_an_ask_after_it_is_done(pool: LookupPool) -> None:
    started, release, lookup = gated([("s3", 64)])
    assert pool.ask("r1", lookup) is None
    assert started.wait(5)
    assert pool.ask("r1", lookup) is None and "r1" in pool  # still running
    release.set()
    settle(pool, 0)
    found = pool.ask("r1", lookup)
    assert found is not None and found.tiers == [("s3", 64)] and not found.timed_out
    assert "r1" not in pool and len(pool) == 0


def test_at_most_max_in_flight_lookups_run_and_the_next_starts_when_one_ends(pool: LookupPool) -> None:
    gates = [gated([]) for _ in range(3)]
    for index, (_, _, lookup) in enumerate(gates):
        assert pool.ask(f"r{index}", lookup) is None
    assert gates[0][0].wait(5) and gates[1][0].wait(5)
    assert pool.in_flight == 2 and not gates[2][0].wait(0.1)  # the third waits for a thread
    gates[0][1].set()
    settle(pool, 1)
    assert pool.ask("r2", gates[2][2]) is None  # asked again: it starts now
    assert gates[2][0].wait(5)
    for _, release, _ in gates:
        release.set()
    settle(pool, 0)
    for index, (_, _, lookup) in enumerate(gates):
        found = pool.ask(f"r{index}", lookup)
        assert found is not None and found.tiers == [] and not found.timed_out


def test_a_lookup_running_past_the_timeout_is_no_hit_and_ends_unseen(pool: LookupPool) -> None:
    clock = pool._clock
    assert isinstance(clock, Clock)
    started, release, lookup = gated([("s3", 64)])
    assert pool.ask("slow", lookup) is None and started.wait(5)
    clock.now = 4.9
    assert pool.ask("slow", lookup) is None
    clock.now = 5.0
    found = pool.ask("slow", lookup)
    assert found is not None and found.tiers == [] and found.timed_out
    assert "slow" not in pool and pool.in_flight == 1  # its thread still runs ...
    release.set()
    settle(pool, 0)  # ... and ends; nothing is left behind
    assert len(pool) == 0


def test_a_request_waiting_for_a_thread_past_the_timeout_is_no_hit(pool: LookupPool) -> None:
    clock = pool._clock
    assert isinstance(clock, Clock)
    gates = [gated([]) for _ in range(2)]
    for index, (_, _, lookup) in enumerate(gates):
        pool.ask(f"busy{index}", lookup)
    never = gated([("s3", 64)])
    assert pool.ask("queued", never[2]) is None
    clock.now = 5.0
    found = pool.ask("queued", never[2])
    assert found is not None and found.timed_out and not never[0].is_set()
    for _, release, _ in gates:
        release.set()


def test_a_lookup_that_raises_is_no_hit(pool: LookupPool) -> None:
    def broken() -> Tiers:
        raise OSError("connection reset")

    deadline = time.monotonic() + 10
    while (found := pool.ask("r", broken)) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert found is not None and found.tiers == [] and not found.timed_out


def test_a_discarded_request_leaves_no_entry(pool: LookupPool) -> None:
    started, release, lookup = gated([("s3", 64)])
    pool.ask("aborted", lookup)
    assert started.wait(5)
    pool.discard("aborted")
    assert len(pool) == 0
    release.set()
    settle(pool, 0)
    assert len(pool) == 0


# --- the scheduler side ---------------------------------------------------------------------


@pytest.fixture
def side(engine: CacheEngine) -> Iterator[SchedulerSide]:
    yield from scheduler(engine)


def slowed(engine: CacheEngine, name: str) -> tuple[threading.Event, threading.Event]:
    """Hold the ``contains`` calls of tier ``name`` until released, as a slow store would."""
    slow = tier(engine, name)
    started, release = threading.Event(), threading.Event()
    contains = slow.contains

    def delayed(asked: Any) -> list[bool]:
        started.set()
        assert release.wait(10)
        return contains(asked)

    slow.contains = delayed  # type: ignore[method-assign]
    return started, release


def only_in_legacy(engine: CacheEngine, keys: list[str]) -> None:
    """Leave ``keys`` only in tier legacy (remote): ram and disk answer lookups inline."""
    tier(engine, "ram").remove(keys)
    tier(engine, "disk").remove(keys)


def test_a_prefix_all_in_memory_is_answered_at_once(side: SchedulerSide) -> None:
    assert side.get_num_new_matched_tokens(request("r-mem"), 0) == (192, False)


def test_a_prefix_on_local_disk_is_answered_at_once(engine: CacheEngine, side: SchedulerSide) -> None:
    """Tier disk answers lookups inline (a stat per key): no background lookup, whose answer
    would wait for the engine's next step, even with a slower tier before it in the chain."""
    keys = [k.key for k in engine.chunk_keys(PROMPT, RequestInfo())]
    tier(engine, "ram").remove(keys)
    tier(engine, "legacy").remove(keys)
    assert side.get_num_new_matched_tokens(request("r-disk"), 0) == (192, True)  # a disk load: background
    assert side._pool is not None and len(side._pool) == 0
    side.update_state_after_alloc(request("r-disk"), BLOCKS, 192)
    assert hit_figures(side.get_kv_connector_stats())["hit_tokens_tier.2:disk"] == 192


def test_a_lookup_needing_a_slower_tier_answers_later_and_counts_once(engine: CacheEngine, side: SchedulerSide) -> None:
    keys = [k.key for k in engine.chunk_keys(PROMPT, RequestInfo())]
    only_in_legacy(engine, keys)
    started, release = slowed(engine, "legacy")
    assert side.get_num_new_matched_tokens(request("r-slow"), 0) == (None, False)  # vLLM asks again later
    assert started.wait(5)
    assert side.get_num_new_matched_tokens(request("r-slow"), 0) == (None, False)
    release.set()
    assert answer(side, request("r-slow"), 0) == (192, True)
    # not admitted this step (no free blocks): the next ask gives the same answer at once
    assert side.get_num_new_matched_tokens(request("r-slow"), 0) == (192, True)
    side.update_state_after_alloc(request("r-slow"), BLOCKS, 192)
    figures = hit_figures(side.get_kv_connector_stats())
    assert figures["lookups"] == 1 and figures["hit_tokens_tier.1:legacy"] == 192


def test_a_request_finished_before_its_lookup_is_done_leaves_nothing(engine: CacheEngine, side: SchedulerSide) -> None:
    keys = [k.key for k in engine.chunk_keys(PROMPT, RequestInfo())]
    only_in_legacy(engine, keys)
    started, release = slowed(engine, "legacy")
    assert side.get_num_new_matched_tokens(request("r-gone"), 0) == (None, False)
    assert started.wait(5)
    side.request_finished(request("r-gone"), [])  # aborted while waiting
    release.set()
    pool = side._pool
    assert pool is not None and len(pool) == 0
    settle(pool, 0)
    assert len(pool) == 0 and not side._states


def test_an_answer_from_memory_drops_the_lookup_an_earlier_ask_started(
    engine: CacheEngine, side: SchedulerSide
) -> None:
    """Left in the pool, that lookup would answer the request after a preemption with
    what it found long before (or a timed-out miss)."""
    keys = [k.key for k in engine.chunk_keys(PROMPT, RequestInfo())]
    values = [bytes(value) for value in tier(engine, "ram").get(keys) if value is not None]
    only_in_legacy(engine, keys)
    started, release = slowed(engine, "legacy")
    assert side.get_num_new_matched_tokens(request("r-back"), 0) == (None, False)
    assert started.wait(5)
    tier(engine, "ram").put(list(zip(keys, values)))  # another request stored the prefix meanwhile
    assert side.get_num_new_matched_tokens(request("r-back"), 0) == (192, False)
    pool = side._pool
    assert pool is not None and len(pool) == 0
    release.set()
    settle(pool, 0)


def test_blocking_lookups_answer_at_once(engine: CacheEngine) -> None:
    keys = [k.key for k in engine.chunk_keys(PROMPT, RequestInfo())]
    tier(engine, "ram").remove(keys)
    for side in scheduler(engine, settings=ConnectorSettings(lookup_channel="direct", background_lookups=False)):
        assert side._pool is None
        assert side.get_num_new_matched_tokens(request("r-block"), 0) == (192, True)


def test_the_settings_name_the_bad_value() -> None:
    from kvplug.errors import ConfigError
    from kvplug_vllm.settings import split_extra_config

    with pytest.raises(ConfigError, match="kvplug.background_lookups"):
        split_extra_config({"kvplug.background_lookups": "sometimes"})
    with pytest.raises(ConfigError, match="kvplug.max_background_lookups"):
        split_extra_config({"kvplug.max_background_lookups": 0})
