"""A load that finds an unusable chunk reports its miss at once: removing the chunk from the
tiers (a remote one may hang) is the chain's removal thread's work, whatever the store
queue's mode and whoever loads (``CacheEngine``, or ``ChunkStore`` directly as SGLang's
HiCache backend does), and a store made after the load is written after the removal."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import LAYOUTS, random_caches

from kvplug import Buffer, CacheEngine, ChunkStore, Fingerprint, RequestInfo, TierChain, hookimpl, load_config
from kvplug.core.control.target import EngineControl
from kvplug.core.engine.locations import hit_tokens
from kvplug.core.plugins import PluginRegistry
from kvplug.testing import gather_chunk, key_for, tier_context, value_for

NUM_BLOCKS = 80
#: How long the test waits for a load; a remove hangs until released (at most HANG_S).
WAIT_S = 30.0
HANG_S = 300.0


def _read(engine: CacheEngine, caches: list[torch.Tensor]) -> torch.Tensor:
    out = torch.empty(engine.layout.chunk_shape(32), dtype=engine.layout.dtype)
    gather_chunk(engine.connector, caches, torch.arange(32), out)
    return out


def _plugin(release: threading.Event, removing: threading.Event, removed: list[str]) -> object:
    from kvplug_cpu import CPUTier

    class SharedMemoryTier(CPUTier):
        """A cpu tier without ``trusted_reads``: its frames are verified on load."""

        name = "shared_memory"
        trusted_reads = False

    class HungRemoveTier(CPUTier):
        """A remote-like tier whose remove hangs until the test releases it."""

        name = "hung_remove"
        trusted_reads = False

        def remove(self, keys: Sequence[str]) -> None:
            removing.set()
            release.wait(HANG_S)
            removed.extend(keys)
            super().remove(keys)

        def remove_if_same(self, items: Sequence[tuple[str, Buffer]]) -> None:
            self.remove([key for key, _ in items])  # by name, as a tier that cannot compare

    class Plugin:
        @staticmethod
        @hookimpl
        def kvplug_storage_tiers() -> list[type]:
            return [SharedMemoryTier, HungRemoveTier]

    return Plugin


def _registry(
    release: threading.Event, removing: threading.Event, removed: list[str], plugins: str = "cpu"
) -> PluginRegistry:
    registry = PluginRegistry(plugin_filter=plugins)
    registry.register(_plugin(release, removing, removed), "hung-remove-test")
    return registry


def _join_or_release(thread: threading.Thread, release: threading.Event) -> bool:
    """Whether ``thread`` (a load) was still waiting after WAIT_S; it is released either way."""
    thread.join(WAIT_S)
    hung = thread.is_alive()
    if hung:
        release.set()  # the old way: the load waits for the remove; nothing waits for ever
        thread.join(WAIT_S)
    return hung


@pytest.mark.parametrize("store_mode", ["async", "sync"])
@pytest.mark.parametrize("hung_tier_mode", ["sync", "async"])
def test_a_corrupt_chunk_is_a_miss_at_once_while_a_tier_hangs_removing_it(store_mode: str, hung_tier_mode: str) -> None:
    release, removing, removed = threading.Event(), threading.Event(), []
    registry = _registry(release, removing, removed)
    tiers = [{"type": "shared_memory"}, {"type": "hung_remove", "queue": {"mode": hung_tier_mode}}]
    engine = _engine_of(registry, tiers, store_mode)
    try:
        source, tokens, key = _stored_prompt(engine)
        fast = engine.chain.tiers[0]
        damaged = bytearray(fast.get([key])[0])
        damaged[-3] ^= 0x10
        fast.put([(key, bytes(damaged))])
        slow = engine.chain.tiers[1]
        super(type(slow), slow).remove([key])  # only the fast tier holds it: a load reads the corrupt copy

        results: list[torch.Tensor] = []
        target = random_caches(engine.layout, NUM_BLOCKS, seed=4)
        loading = threading.Thread(target=lambda: results.append(engine.retrieve(tokens, target, torch.arange(32))))
        loading.start()
        assert removing.wait(WAIT_S)  # the removal began (and hangs in the slow tier)
        assert not _join_or_release(loading, release), "the load waited for the tier's remove"
        assert results[0].tolist() == [True] * 16 + [False] * 16

        # A store made after the load, while the removal still hangs, lands after it: kept.
        assert engine.lookup(tokens) == 16
        assert engine.store(tokens, source, torch.arange(32)) == 8
        release.set()
        engine.flush()
        assert removed == [key]
        assert engine.lookup(tokens) == 32
        again = random_caches(engine.layout, NUM_BLOCKS, seed=5)
        assert engine.retrieve(tokens, again, torch.arange(32)).all()
        assert torch.equal(_read(engine, source).view(torch.uint8), _read(engine, again).view(torch.uint8))
    finally:
        release.set()
        engine.close()


def test_a_chunk_store_load_does_not_wait_for_a_hung_remove_and_a_later_put_survives_it() -> None:
    """``ChunkStore`` used directly (SGLang's ``KVPlugStorage``): no store worker of its own."""
    release, removing, removed = threading.Event(), threading.Event(), []
    registry = _registry(release, removing, removed)
    tiers = [{"type": "shared_memory"}, {"type": "hung_remove"}]
    config = load_config(engine_extra={"kvplug": {"tiers": tiers}}, env={}, registry=registry).config
    store = ChunkStore.open(
        config, Fingerprint(model_id="m", dtype="float32", kv_layout="pages", block_size=4), registry=registry
    )
    try:
        pages = [torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        keys = [store.key_prefix + f"{i:064x}" for i in range(3)]
        store.put_tensors(list(zip(keys, pages)))
        store.flush()
        fast, slow = store.chain.tiers
        damaged = bytearray(fast.get([keys[1]])[0])
        damaged[-3] ^= 0x10
        fast.put([(keys[1], bytes(damaged))])
        super(type(slow), slow).remove([keys[1]])

        shapes = [(2, 4, 8)] * 3
        results: list[int] = []
        loading = threading.Thread(
            target=lambda: results.append(len(store.load_prefix(keys, shapes, torch.float32).tensors))
        )
        loading.start()
        assert removing.wait(WAIT_S)
        assert not _join_or_release(loading, release), "the load waited for the tier's remove"
        assert results == [1]

        store.put_tensors([(keys[1], pages[1])])  # asked for after the removal: written after it
        release.set()
        store.flush()
        assert removed == [keys[1]]
        loaded = store.load_prefix(keys, shapes, torch.float32).tensors
        assert [t.tolist() for t in loaded] == [p.tolist() for p in pages]
    finally:
        release.set()
        store.close()


def test_a_good_record_another_writer_stores_before_the_removal_survives_it(tmp_path: Path) -> None:
    """The removal carries the bytes the load read: the disk tier removes the record only
    while its folder still holds them, so a good record stored meanwhile is kept."""
    from kvplug_disk import DiskTier

    release, removing, removed = threading.Event(), threading.Event(), []
    registry = _registry(release, removing, removed, "cpu,disk")
    disk = {"type": "disk", "path": str(tmp_path / "disk"), "queue": {"mode": "sync"}}
    # The hung tier comes first: the removal waits there before it reaches the disk tier.
    config = load_config(
        engine_extra={"kvplug": {"tiers": [{"type": "hung_remove"}, disk]}}, env={}, registry=registry
    ).config
    store = ChunkStore.open(
        config, Fingerprint(model_id="m", dtype="float32", kv_layout="pages", block_size=4), registry=registry
    )
    writer = DiskTier(DiskTier.Config(path=tmp_path / "disk", queue={"mode": "sync"}), tier_context())
    try:
        page = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
        key = store.key_prefix + "ab" * 32
        writer.put([(key, store.serializer.dumps(page.to(torch.float16)))])  # another dtype: unusable
        loading = threading.Thread(target=lambda: store.load_prefix([key], [(2, 4, 8)], torch.float32))
        loading.start()
        assert removing.wait(WAIT_S)  # the removal waits in the first tier: the disk still holds the bad record
        writer.put([(key, store.serializer.dumps(page))])  # another engine stores the good one
        release.set()
        loading.join(WAIT_S)
        store.flush()
        assert removed == [key]
        loaded = store.load_prefix([key], [(2, 4, 8)], torch.float32).tensors
        assert len(loaded) == 1, "the good record stored before the removal was removed"
        assert torch.equal(loaded[0], page)
    finally:
        release.set()
        writer.close()
        store.close()


def _damaged_in_the_slower_tier(engine: CacheEngine, key: str) -> None:
    """Only the second tier holds ``key``'s record, and damaged."""
    hung, shared = engine.chain.tiers
    super(type(hung), hung).remove([key])
    damaged = bytearray(shared.get([key])[0])
    damaged[-3] ^= 0x10
    shared.put([(key, bytes(damaged))])


@pytest.mark.parametrize("store_mode", ["async", "sync"])
def test_until_its_removal_lands_a_corrupt_chunk_is_a_miss_and_a_store_of_it_is_kept(store_mode: str) -> None:
    """The removal waits in a first tier while a slower one still holds the corrupt copy: a
    lookup must not promise it, and a store must not take it for stored (then skip it, and
    lose it to the removal)."""
    release, removing, removed = threading.Event(), threading.Event(), []
    registry = _registry(release, removing, removed)
    engine = _engine_of(registry, [{"type": "hung_remove"}, {"type": "shared_memory"}], store_mode)
    try:
        source, tokens, key = _stored_prompt(engine)
        _damaged_in_the_slower_tier(engine, key)

        target = random_caches(engine.layout, NUM_BLOCKS, seed=4)
        assert engine.retrieve(tokens, target, torch.arange(32)).tolist() == [True] * 16 + [False] * 16
        assert removing.wait(WAIT_S)  # the removal hangs in the first tier; the second still holds the copy
        assert engine.lookup(tokens) == 16, "a lookup promised the chunk whose removal is on its way"
        assert engine.store(tokens, source, torch.arange(32)) == 8, "the store took the corrupt chunk for stored"
        release.set()
        engine.flush()
        assert engine.lookup(tokens) == 32
        again = random_caches(engine.layout, NUM_BLOCKS, seed=5)
        assert engine.retrieve(tokens, again, torch.arange(32)).all()
        assert torch.equal(_read(engine, source).view(torch.uint8), _read(engine, again).view(torch.uint8))
    finally:
        release.set()
        engine.close()


def test_until_its_removal_lands_an_inline_lookup_does_not_promise_a_corrupt_chunk() -> None:
    """The lookup answered on the caller's thread (memory tiers: vLLM's scheduler asks it first)
    and ``kvplug ctl explain``'s chunk map ask the tiers themselves, as a pin does: a chunk whose
    removal is on its way is not a hit there either, nor pinned."""
    release, removing, removed = threading.Event(), threading.Event(), []
    registry = _registry(release, removing, removed)
    engine = _engine_of(registry, [{"type": "hung_remove"}, {"type": "shared_memory"}], "sync")
    try:
        _, tokens, key = _stored_prompt(engine)
        _damaged_in_the_slower_tier(engine, key)

        target = random_caches(engine.layout, NUM_BLOCKS, seed=4)
        assert engine.retrieve(tokens, target, torch.arange(32)).tolist() == [True] * 16 + [False] * 16
        assert removing.wait(WAIT_S)  # the removal hangs in the first tier; the second still holds the copy
        found = engine.locate_inline(tokens)
        assert found is None or hit_tokens(found) <= 16, "an inline lookup promised the chunk being removed"
        explained = EngineControl(engine).explain(tokens, RequestInfo())  # kvplug ctl explain
        assert explained["hit_tokens"] == 16, "ctl explain showed the chunk being removed as held"
        assert "removal" in explained["notes"].get("chain", ""), explained["notes"]
        assert "a load found it unusable" in explained["reason"], explained["reason"]
        pinned = engine.pin(tokens)  # kvplug ctl pin: pinned when stored again, not now
        assert (pinned.chunks, pinned.missing) == (3, 1), pinned
    finally:
        release.set()
        engine.close()


def test_close_lands_the_removals_on_their_way_and_a_later_one_is_refused_quietly(tmp_path: Path) -> None:
    from kvplug_disk import DiskTier

    def open_disk() -> DiskTier:
        return DiskTier(DiskTier.Config(path=tmp_path / "disk", queue={"mode": "sync"}), tier_context())

    chain = TierChain([open_disk()])
    bad, other = key_for("found unusable"), key_for("other")
    chain.put([(bad, value_for("bad", 3000)), (other, value_for("other", 3000))])
    chain.discard_later([(bad, value_for("bad", 3000))])
    chain.close()  # the removal is written before the tiers close
    chain.discard_later([(other, value_for("other", 3000))])  # a load racing the close: nothing done, no error
    assert not [t for t in threading.enumerate() if t.name == "kvplug-discards" and t.is_alive()]
    reopened = open_disk()
    try:
        assert reopened.contains([bad, other]) == [False, True]
    finally:
        reopened.close()


def _engine_of(registry: PluginRegistry, tiers: list[dict[str, Any]], store_mode: str) -> CacheEngine:
    """An engine of chunks of 8 (vLLM's flash layout) over ``tiers``, its store queue in ``store_mode``."""
    layout = LAYOUTS["vllm_flash"]
    settings = {"chunk_size": 8, "store": {"queue": {"mode": store_mode}}, "tiers": tiers}
    config = load_config(engine_extra={"kvplug": settings}, env={}, registry=registry).config
    return CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry)


def _stored_prompt(engine: CacheEngine) -> tuple[Any, list[int], str]:
    """A prompt of four chunks stored and flushed: its source caches, its tokens, its third chunk's key."""
    source = random_caches(engine.layout, NUM_BLOCKS, seed=3)
    tokens = list(range(100, 132))
    assert engine.store(tokens, source, torch.arange(32)) == 32
    engine.flush()
    return source, tokens, engine.chunk_keys(tokens)[2].key
