"""Units of the fleet features that need no vLLM engine: location merging, the chunk index's
vLLM events (also from a real kvplug cache engine's tiers), and how connector stats merge
(counters, gauges, latency samples)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvplug import (
    CacheEngine,
    ChunkKey,
    ChunkLocation,
    Fingerprint,
    KVEvent,
    KVLayout,
    PagedFormat,
    load_config,
    merge_locations,
)
from kvplug_vllm.background import BackgroundLoads, _Pending
from kvplug_vllm.kv_events import ChunkIndex, KVPlugKVEvents
from kvplug_vllm.stats import KVPlugConnectorStats


def test_merge_locations_takes_the_shortest_prefix_and_the_slowest_tier() -> None:
    cpu, disk, s3 = (
        ChunkLocation("memory", "cpu", 64),
        ChunkLocation("disk", "disk", 64),
        ChunkLocation("remote", "s3", 64),
    )
    a = [cpu, cpu, disk]
    assert merge_locations([a, [cpu, s3]]) == [cpu, s3]
    assert merge_locations([a]) == a
    assert merge_locations([]) == []


def key(index: int, start: int, end: int) -> ChunkKey:
    return ChunkKey(index, start, end, f"1/{'ab' * 16}/{index:064x}")


def test_chunk_index_publishes_vllm_block_hashes_per_tier_and_evictions() -> None:
    index = ChunkIndex(block_size=4, tier_names=["cpu", "disk"])
    tokens = list(range(100, 118))  # 4 blocks of 4 and 2 tokens
    hashes = [b"h0", b"h1", b"h2", b"h3"]
    keys = [key(0, 0, 8), key(1, 8, 16), key(2, 16, 18)]  # the last chunk ends inside a block
    index.remember(keys, tokens, hashes, lora_name=None)
    every = (keys[0].key, keys[1].key, keys[2].key)
    index.on_event(KVEvent("stored", every))  # the engine's hand-over: no tier holds them yet
    assert index.take() == []
    index.on_event(KVEvent("stored", every, tier="cpu"))  # the cpu tier holds them; disk's write never landed
    events = index.take()
    assert [(e.medium, e.block_hashes, e.parent_block_hash) for e in events] == [
        ("cpu", [b"h0", b"h1"], None),
        ("cpu", [b"h2", b"h3"], b"h1"),
    ]
    assert all(isinstance(e, BlockStored) and e.block_size == 4 for e in events)
    assert events[1].token_ids == tokens[8:16]
    index.on_event(KVEvent("evicted", (keys[0].key,), tier="cpu"))
    index.on_event(KVEvent("evicted", ("1/unknown/00",), tier="cpu"))  # not ours: nothing
    (removed,) = index.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [b"h0", b"h1"] and removed.medium == "cpu"
    assert index.take() == []


def test_chunk_index_publishes_nothing_for_chunks_without_vllm_blocks() -> None:
    index = ChunkIndex(block_size=4, tier_names=["cpu"])
    index.remember([key(0, 0, 8)], list(range(8)), [], lora_name=None)  # no hashes sent
    index.on_event(KVEvent("stored", (key(0, 0, 8).key,), tier="cpu"))
    assert index.take() == []


def test_a_chunk_the_index_stops_remembering_is_published_removed() -> None:
    """Past ``max_chunks`` held chunks the oldest is forgotten: its later eviction could no longer
    be published, so a router would believe it held for good. It is published removed from every
    medium when forgotten."""
    index = ChunkIndex(block_size=4, tier_names=["cpu", "disk", "disk"], max_chunks=2)
    tokens = list(range(100, 116))
    hashes = [b"h0", b"h1", b"h2", b"h3"]
    index.remember([key(0, 0, 4), key(1, 4, 8)], tokens, hashes, lora_name=None)
    index.on_event(KVEvent("stored", (key(0, 0, 4).key, key(1, 4, 8).key), tier="cpu"))
    assert [type(e) for e in index.take()] == [BlockStored, BlockStored]
    index.remember([key(2, 8, 16)], tokens, hashes, lora_name=None)
    assert index.take() == []  # no tier holds it yet: the two held are all remembered
    index.on_event(KVEvent("stored", (key(2, 8, 16).key,), tier="cpu"))
    assert [(type(e), e.block_hashes, e.medium) for e in index.take()] == [
        (BlockRemoved, [b"h0"], "cpu"),
        (BlockRemoved, [b"h0"], "disk"),
        (BlockStored, [b"h2", b"h3"], "cpu"),
    ]
    index.on_event(KVEvent("evicted", (key(0, 0, 4).key,), tier="cpu"))  # no longer remembered: nothing more
    assert index.take() == []


def test_the_index_remembers_what_the_tiers_hold_not_every_chunk_ever_stored() -> None:
    """A chunk that left every tier, a write that never landed (declined, dropped) and a chunk
    without vLLM blocks are not remembered for good: the index of an engine that runs for weeks
    stays the size of what its tiers hold (test_soak.py sees it on a real engine)."""
    index = ChunkIndex(block_size=4, tier_names=["cpu", "disk"])
    tokens = list(range(100, 124))
    hashes = [f"h{i}".encode() for i in range(6)]
    index.remember([key(0, 0, 4), key(1, 4, 8), key(2, 8, 10)], tokens, hashes, lora_name=None)
    assert index.chunks.held_keys() == []  # no tier holds them yet; the partial chunk: never published
    index.on_event(KVEvent("stored", (key(0, 0, 4).key,), tier="cpu"))
    index.on_event(KVEvent("stored", (key(0, 0, 4).key,), tier="disk"))
    index.on_event(KVEvent("evicted", (key(0, 0, 4).key,), tier="cpu"))
    assert index.chunks.held_keys() == [key(0, 0, 4).key]  # disk still holds it
    index.on_event(KVEvent("evicted", (key(0, 0, 4).key,), tier="disk"))
    assert index.chunks.held_keys() == [] and index.chunks.holders(key(0, 0, 4).key) == set()
    index.take()
    # a write that lands after the chunk left every tier is still published
    index.on_event(KVEvent("stored", (key(0, 0, 4).key,), tier="disk"))
    assert [(type(e), e.medium) for e in index.take()] == [(BlockStored, "disk")]
    assert index.chunks.held_keys() == [key(0, 0, 4).key]
    # chunks whose writes never land: the oldest are forgotten past max_waiting
    bounded = ChunkIndex(block_size=4, tier_names=["cpu"], max_waiting=2)
    bounded.remember([key(3, 12, 16), key(4, 16, 20), key(5, 20, 24)], tokens, hashes, lora_name=None)
    assert (
        bounded.chunks.waiting_keys() == [key(4, 16, 20).key, key(5, 20, 24).key] and bounded.chunks.held_keys() == []
    )


def test_a_chunk_one_of_two_disk_tiers_evicts_is_not_published_removed_while_the_other_holds_it(
    tmp_path: Path,
) -> None:
    """Two tiers of one type (two disk folders) publish as one medium, ``disk``. The first
    (small) evicting a chunk the second still holds must not publish it removed: a router
    would stop sending its prefix here while the second tier still serves it."""
    layout = KVLayout(PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim")), 3, 8, 2, 4, torch.bfloat16)
    small = {"type": "disk", "path": str(tmp_path / "small"), "max_bytes": 4000}  # two 16-token chunks
    kv = {
        "chunk_size": 16,
        "store": {"queue": {"mode": "sync"}},
        "tiers": [small, {"type": "disk", "path": str(tmp_path / "big")}],
    }
    config = load_config(engine_extra={"kvplug": kv}, env={}).config
    caches = [torch.randn(2, 16, 8, 2, 4).to(torch.bfloat16) for _ in range(3)]
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="two-disks")) as engine:
        index = ChunkIndex(layout.block_size, [t.type for t in config.tiers])
        engine.add_event_listener(index.on_event)
        first, second = list(range(32)), list(range(1000, 1032))
        for tokens in (first, second):
            keys = engine.chunk_keys(tokens)
            index.remember(keys, tokens, [f"{tokens[0]}/{i}".encode() for i in range(4)], lora_name=None)
            engine.store(tokens, caches, torch.arange(32))
            engine.flush()
        first_keys = [k.key for k in engine.chunk_keys(first)]
        small_tier, big_tier = engine.chain.tiers
        assert small_tier.contains(first_keys) == [False, False]  # the small one evicted them
        assert big_tier.contains(first_keys) == [True, True]
        events = index.take()
        big_tier.remove(first_keys)  # now no disk tier holds them: published removed
        gone = index.take()
    assert [e for e in events if isinstance(e, BlockRemoved)] == []
    assert {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes} == {
        f"{t}/{i}".encode() for t in (0, 1000) for i in range(4)
    }
    assert [(type(e), e.medium) for e in gone] == [(BlockRemoved, "disk")]
    assert sorted(h for e in gone for h in e.block_hashes) == [f"0/{i}".encode() for i in range(4)]


def test_events_of_several_workers_are_published_once_all_report_them() -> None:
    event = BlockRemoved(block_hashes=[b"h0"], medium="cpu")
    merged = KVPlugKVEvents(1)
    merged.add_events([event])
    other = KVPlugKVEvents(1)
    other.add_events([event, BlockRemoved(block_hashes=[b"h9"], medium="cpu")])
    merged.add_events(other.get_all_events())
    merged.increment_workers(other.get_number_of_workers())
    assert merged.aggregate().get_all_events() == [event]


def test_stats_sum_counters_keep_the_latest_gauge_and_concatenate_samples() -> None:
    first = KVPlugConnectorStats()
    first.add(lookups=1, **{"hit_tokens_tier.cpu": 64})
    first.sample("lookup_seconds", 0.5)
    first.data["gauge.breaker_state.0:s3"] = 2.0
    second = KVPlugConnectorStats()
    second.add(lookups=2, **{"hit_tokens_tier.cpu": 128})
    second.sample("lookup_seconds", 0.25)
    second.data["gauge.breaker_state.0:s3"] = 0.0
    merged = KVPlugConnectorStats().aggregate(first).aggregate(second)
    assert merged.data["lookups"] == 3 and merged.data["hit_tokens_tier.cpu"] == 192
    assert merged.data["lookup_seconds"] == [0.5, 0.25]
    assert merged.data["gauge.breaker_state.0:s3"] == 0.0
    totals = KVPlugConnectorStats().aggregate(first, counts_only=True)
    assert "lookup_seconds" not in totals.data and "gauge.breaker_state.0:s3" not in totals.data


def test_an_idle_step_waits_for_a_background_load_instead_of_spinning() -> None:
    """vLLM calls get_finished in a busy loop while every request waits for its KV; the
    worker waits on the loads there (GIL released) rather than return at once."""
    loads = BackgroundLoads(timeout_s=10)
    started = time.monotonic()
    loads.wait(5.0)  # nothing in flight: returns at once, not after 5 s
    assert time.monotonic() - started < 1.0

    release = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(release.wait)
        loads._pending["r"] = _Pending(request=None, future=future, started=started, deadline=started + 10)  # type: ignore[arg-type]
        started = time.monotonic()
        loads.wait(0.05)  # in flight and not done: waits the whole timeout
        assert time.monotonic() - started >= 0.045
        threading.Timer(0.01, release.set).start()
        started = time.monotonic()
        loads.wait(5.0)  # returns as soon as the load is over
        assert time.monotonic() - started < 1.0


def test_a_tier_that_never_announced_a_chunk_does_not_publish_it_removed(tmp_path: Path) -> None:
    """A disk record from before a restart, loaded (and so promoted to the cpu tier: published
    there), then evicted from disk: on ee9bb23 the index published a BlockRemoved with medium
    ``disk`` for a chunk it never published stored on disk. Only a tier that said it holds a
    chunk takes it back (kvplug.HeldChunks)."""
    layout = KVLayout(PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim")), 3, 8, 2, 4, torch.bfloat16)
    disk = {"type": "disk", "path": str(tmp_path / "d"), "max_bytes": 4000}  # two 16-token chunks
    fingerprint = Fingerprint.for_layout(layout, model_id="restart")
    caches = [torch.randn(2, 16, 8, 2, 4).to(torch.bfloat16) for _ in range(3)]
    old = list(range(16))
    kv = {"chunk_size": 16, "store": {"queue": {"mode": "sync"}}, "tiers": [disk]}
    with CacheEngine(load_config(engine_extra={"kvplug": kv}, env={}).config, layout, fingerprint) as engine:
        engine.store(old, caches, torch.arange(16))  # before the restart
    kv["tiers"] = [{"type": "cpu"}, disk]
    config = load_config(engine_extra={"kvplug": kv}, env={}).config
    with CacheEngine(config, layout, fingerprint) as engine:
        index = ChunkIndex(layout.block_size, [t.type for t in config.tiers], engine.writes_in_flight)
        engine.add_event_listener(index.on_event)
        old_hashes = [b"old/0", b"old/1"]
        index.remember(engine.chunk_keys(old), old, old_hashes, lora_name=None)
        assert int(engine.retrieve(old, caches, torch.arange(16)).sum()) == 16  # promoted to cpu
        for first in (1000, 2000):  # two new chunks: the disk tier evicts the old one
            tokens = list(range(first, first + 16))
            index.remember(engine.chunk_keys(tokens), tokens, [f"{first}/{i}".encode() for i in range(2)], None)
            engine.store(tokens, caches, torch.arange(16))
            engine.flush()
        assert engine.chain.tiers[1].contains([engine.chunk_keys(old)[0].key]) == [False]
        events = index.take()
    about_old = [(type(e), e.medium) for e in events if set(e.block_hashes) & set(old_hashes)]
    assert about_old == [(BlockStored, "cpu")]  # ee9bb23: also (BlockRemoved, "disk")
