"""kvplug.HeldChunks: which chunks some tier holds, per medium, as routers are told (the one
index kvplug-vllm's ChunkIndex and kvplug-sglang's KVEventBridge keep)."""

from __future__ import annotations

import pytest

from kvplug import HeldChange, HeldChunks, KVEvent
from kvplug.core.plugins import PluginRegistry


@pytest.fixture
def registry() -> PluginRegistry:
    return PluginRegistry(plugin_filter="cpu,disk")


def media(tier: str) -> str:
    return {"cpu": "memory", "shm": "memory", "disk": "disk"}.get(tier, "remote")


def kinds(changes: list[HeldChange[str]]) -> list[tuple[str, str, str | None, bool]]:
    return [(c.kind, c.key, c.medium, c.first) for c in changes]


def test_a_chunk_is_stored_once_per_medium_and_removed_when_no_tier_of_it_holds_it() -> None:
    held: HeldChunks[str] = HeldChunks(media)
    held.expect("k", "tokens of k")
    assert held.observe(KVEvent("stored", ("k",))) == []  # the engine's hand-over: no tier holds it
    assert kinds(held.observe(KVEvent("stored", ("k",), tier="cpu", tier_index=0))) == [("stored", "k", "memory", True)]
    assert kinds(held.observe(KVEvent("stored", ("k",), tier="shm", tier_index=1))) == [
        ("stored", "k", "memory", False)
    ]
    # a tier that never said it holds it takes nothing back
    assert held.observe(KVEvent("evicted", ("k",), tier="disk", tier_index=2)) == []
    assert held.observe(KVEvent("evicted", ("k",), tier="cpu", tier_index=0)) == []  # shm still holds it
    assert kinds(held.observe(KVEvent("removed", ("k",), tier="shm", tier_index=1))) == [
        ("removed", "k", "memory", False)
    ]
    assert held.held_keys() == [] and held.waiting_keys() == ["k"] and held.holders("k") == set()
    # a write that lands after it left every tier is still told
    assert [c.chunk for c in held.observe(KVEvent("stored", ("k",), tier="disk", tier_index=2))] == ["tokens of k"]


def test_a_held_chunk_forgotten_past_max_held_names_the_media_that_held_it_before_a_later_store() -> None:
    held: HeldChunks[str] = HeldChunks(media, max_held=1)
    held.expect("a", "A")
    held.expect("b", "B")
    held.observe(KVEvent("stored", ("a",), tier="disk", tier_index=0))
    changes = held.observe(KVEvent("stored", ("b",), tier="cpu", tier_index=1))
    assert [(c.kind, c.key, c.media) for c in changes] == [("forgotten", "a", ("disk",)), ("stored", "b", ())]
    assert held.held_keys() == ["b"] and held.observe(KVEvent("evicted", ("a",), tier="disk", tier_index=0)) == []
    assert held.observe(KVEvent("stored", ("a",), tier="disk", tier_index=0)) == [] and held.unknown_stored == 1


def test_bounds_must_be_usable() -> None:
    with pytest.raises(ValueError, match="max_held >= 1"):
        HeldChunks(media, max_held=0)


def test_writes_in_flight_are_those_that_may_still_land(make_engine, tmp_path) -> None:
    """CacheEngine.writes_in_flight: a write queued for the store thread or an async tier (here
    held by a listener that is stuck) may still land; once it landed, or for a key never stored,
    none is."""
    import threading

    import torch
    from core_helpers import LAYOUTS, random_caches

    layout = LAYOUTS["vllm_flash"]
    disk = {"type": "disk", "path": str(tmp_path / "d"), "queue": {"mode": "async"}}
    engine = make_engine(layout, tiers=[disk], **{"store.queue.mode": "async"})
    gate, stuck = threading.Event(), threading.Event()

    def listener(event: KVEvent) -> None:
        if event.tier == "disk" and not gate.is_set():
            stuck.set()
            gate.wait()

    engine.add_event_listener(listener)
    first, late = list(range(8)), list(range(100, 108))
    engine.store(first, random_caches(layout, 80, seed=1), torch.arange(8))
    stuck.wait()  # the disk tier's write thread is held
    engine.store(late, random_caches(layout, 80, seed=2), torch.arange(8))
    keys = [engine.chunk_keys(first)[0].key, engine.chunk_keys(late)[0].key, "1/" + "ab" * 16 + "/" + "0" * 64]
    assert engine.writes_in_flight(keys) == [True, True, False]
    gate.set()
    engine.flush()
    assert engine.writes_in_flight(keys) == [False, False, False]


def test_waiting_chunks_whose_writes_may_land_are_kept_past_the_bound_until_they_cannot() -> None:
    landing = {"a", "b"}
    held: HeldChunks[str] = HeldChunks(media, max_waiting=2, in_flight=lambda keys: [k in landing for k in keys])
    for key in "abcde":
        held.expect(key, key.upper())
    # c and d forgotten (their writes cannot land), a and b kept past the bound: theirs may
    assert sorted(held.waiting_keys()) == ["a", "b", "e"]
    landing.clear()  # a's and b's writes were dropped after all: the next chunk pushes them out
    held.expect("f", "F")
    assert len(held.waiting_keys()) == 2 and "f" in held.waiting_keys()


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_write_landed_while_another_thread_delivers_its_tiers_events_is_announced(
    make_engine, tmp_path, tier: str
) -> None:
    """A write lands in a tier (cpu; disk, a RecordTier) while another thread delivers its events (its
    listener is slow: a gate): the put returns, its ``stored`` queued behind the other thread's
    (OrderedEvents). Until that ``stored`` is delivered its write may still be announced: on
    5b43c13 ``writes_in_flight`` said no, so chunks expected after it pushed it out of the
    waiting chunks and its ``stored``, delivered later, was never announced."""
    import threading

    import torch
    from core_helpers import LAYOUTS, random_caches

    layout = LAYOUTS["vllm_flash"]
    spec = (
        {"type": "cpu"} if tier == "cpu" else {"type": "disk", "path": str(tmp_path / "d"), "queue": {"mode": "sync"}}
    )
    engine = make_engine(layout, tiers=[spec])
    held: HeldChunks[str] = HeldChunks(media, max_waiting=1, in_flight=engine.writes_in_flight)
    lock = threading.Lock()  # the adapter's lock: HeldChunks is not thread-safe
    changes: list[HeldChange[str]] = []
    gate, stuck = threading.Event(), threading.Event()

    def slow(event: KVEvent) -> None:
        if event.tier == tier and not gate.is_set():
            stuck.set()
            gate.wait(timeout=60)

    def observe(event: KVEvent) -> None:
        with lock:
            changes.extend(held.observe(event))

    engine.add_event_listener(slow)
    engine.add_event_listener(observe)
    first, late = list(range(8)), list(range(100, 108))
    delivering = threading.Thread(target=engine.store, args=(first, random_caches(layout, 80, seed=1), torch.arange(8)))
    delivering.start()
    try:
        assert stuck.wait(timeout=60)  # that thread delivers the tier's events, held in the slow listener
        late_key = engine.chunk_keys(late)[0].key
        with lock:
            held.expect(late_key, "late")
        engine.store(late, random_caches(layout, 80, seed=2), torch.arange(8))  # landed; its "stored" queued
        assert engine.writes_in_flight([late_key]) == [True]  # 5b43c13: [False], the event not delivered
        with lock:
            for other in ("other1", "other2", "other3"):  # writes that cannot land: pushed out first
                held.expect(other, other)
    finally:  # the delivering thread is let go whatever failed above
        gate.set()
    delivering.join(timeout=60)
    assert not delivering.is_alive()
    engine.flush()
    assert engine.writes_in_flight([late_key]) == [False]  # delivered now
    assert [c.key for c in changes if c.kind == "stored"] == [late_key]
