"""CacheEngine with the cpu tier: exact round trips, prefixes, failures as misses."""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import pytest
import torch
from core_helpers import LAYOUTS, random_caches

from kvplug import CacheEngine, Fingerprint, RequestInfo, StorageTier, TierStats, load_config, slots_from_block_ids
from kvplug.core.plugins import PluginRegistry
from kvplug.errors import EngineClosedError, LayoutError
from kvplug.testing import gather_chunk

NUM_BLOCKS = 80


def block_slots(layout, blocks: list[int], num_tokens: int) -> torch.Tensor:
    return slots_from_block_ids(blocks, layout.block_size, num_tokens)


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def read_back(engine: CacheEngine, caches, slots: torch.Tensor) -> torch.Tensor:
    out = torch.empty(engine.layout.chunk_shape(slots.numel()), dtype=engine.layout.dtype)
    gather_chunk(engine.connector, caches, slots, out)
    return out


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_store_then_retrieve_restores_the_exact_bytes(kind: str, make_engine) -> None:
    layout = LAYOUTS[kind]
    engine = make_engine(layout)
    tokens = prompt(32)
    src_blocks = list(range(0, NUM_BLOCKS // 2))
    dst_blocks = list(range(NUM_BLOCKS // 2, NUM_BLOCKS))[::-1]
    source = random_caches(layout, NUM_BLOCKS, seed=1)
    src_slots = block_slots(layout, src_blocks, 32)
    dst_slots = block_slots(layout, dst_blocks, 32)

    assert engine.lookup(tokens) == 0
    assert engine.store(tokens, source, src_slots) == 32
    assert engine.lookup(tokens) == 32
    target = random_caches(layout, NUM_BLOCKS, seed=2)
    loaded = engine.retrieve(tokens, target, dst_slots)
    assert loaded.all()
    assert torch.equal(
        read_back(engine, source, src_slots).view(torch.uint8), read_back(engine, target, dst_slots).view(torch.uint8)
    )


def test_lookup_is_chunk_aligned_and_prefix_shared(make_engine) -> None:
    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout)
    caches = random_caches(layout, NUM_BLOCKS)
    tokens = prompt(30)
    engine.store(tokens, caches, torch.arange(30))
    assert engine.lookup(tokens) == 24  # three whole chunks of 8; the last 6 tokens are not stored
    assert engine.lookup([*tokens[:20], 7, 7, 7, 7]) == 16
    assert engine.lookup([1, *tokens[1:]]) == 0


def test_save_unfull_chunk_makes_the_full_prompt_hit(make_engine) -> None:
    layout = LAYOUTS["sglang_mha"]
    engine = make_engine(layout, save_unfull_chunk=True)
    caches = random_caches(layout, NUM_BLOCKS)
    tokens = prompt(30)
    assert engine.store(tokens, caches, torch.arange(30)) == 30
    assert engine.lookup(tokens) == 30
    assert engine.lookup([*tokens, 1, 2, 3]) == 24  # a longer prompt only shares whole chunks


def _untrusted_memory_plugin():
    """A cpu tier without ``trusted_reads``: like shared memory another process could write."""
    from kvplug import hookimpl
    from kvplug_cpu import CPUTier

    class SharedMemoryTier(CPUTier):
        name = "shared_memory"
        trusted_reads = False

    class Plugin:
        @staticmethod
        @hookimpl
        def kvplug_storage_tiers():
            return [SharedMemoryTier]

    return Plugin


def _engine_on(tiers: list[dict], registry: PluginRegistry, layout) -> CacheEngine:
    config = load_config(
        engine_extra={"kvplug": {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}},
        env={},
        registry=registry,
    ).config
    return CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry)


def test_flipped_byte_shortens_the_hit_and_never_loads_wrong_data() -> None:
    registry = PluginRegistry(plugin_filter="cpu")
    registry.register(_untrusted_memory_plugin(), "untrusted-test")
    layout = LAYOUTS["vllm_flash"]
    with _engine_on([{"type": "shared_memory"}], registry, layout) as engine:
        source = random_caches(layout, NUM_BLOCKS, seed=3)
        tokens = prompt(32)
        engine.store(tokens, source, torch.arange(32))
        keys = [k.key for k in engine.chunk_keys(tokens)]
        tier = engine.chain.tiers[0]
        damaged = bytearray(tier.get([keys[2]])[0])
        damaged[-3] ^= 0x10
        tier.put([(keys[2], bytes(damaged))])

        target = random_caches(layout, NUM_BLOCKS, seed=4)
        before = [c.clone() for c in target]
        slots = torch.arange(32) + 64
        loaded = engine.retrieve(tokens, target, slots)
        assert loaded.tolist() == [True] * 16 + [False] * 16
        assert torch.equal(read_back(engine, source, torch.arange(16)), read_back(engine, target, slots[:16]))
        assert torch.equal(read_back(engine, before, slots[16:]), read_back(engine, target, slots[16:]))
        assert engine.metrics.value("kvplug_load_errors_total", reason="CorruptChunkError") == 1
        assert engine.lookup(tokens) == 16  # the corrupt chunk was dropped from the tiers


def test_a_corrupt_chunk_from_a_slower_tier_is_not_promoted_into_a_trusted_one() -> None:
    """The cpu tier's frames are not re-verified (trusted_reads), so only verified
    chunks may be promoted into it."""
    registry = PluginRegistry(plugin_filter="cpu")
    registry.register(_untrusted_memory_plugin(), "untrusted-test")
    layout = LAYOUTS["vllm_flash"]
    with _engine_on([{"type": "cpu"}, {"type": "shared_memory"}], registry, layout) as engine:
        source = random_caches(layout, NUM_BLOCKS, seed=3)
        tokens = prompt(32)
        engine.store(tokens, source, torch.arange(32))
        keys = [k.key for k in engine.chunk_keys(tokens)]
        cpu, slow = engine.chain.tiers
        cpu.remove(keys)  # as if evicted: the next load comes from the slower tier
        damaged = bytearray(slow.get([keys[1]])[0])
        damaged[-3] ^= 0x10
        slow.put([(keys[1], bytes(damaged))])

        loaded = engine.retrieve(tokens, random_caches(layout, NUM_BLOCKS), torch.arange(32) + 64)
        assert loaded.tolist() == [True] * 8 + [False] * 24
        assert cpu.contains(keys) == [True, False, False, False]  # the verified chunk only
        assert engine.lookup(tokens) == 8


def test_frames_only_trusted_tiers_hold_skip_the_checksum_and_others_are_sealed() -> None:
    from kvplug.core import chunk_format

    registry = PluginRegistry(plugin_filter="cpu")
    registry.register(_untrusted_memory_plugin(), "untrusted-test")
    layout = LAYOUTS["vllm_flash"]
    for tiers, sealed in (([{"type": "cpu"}], False), ([{"type": "cpu"}, {"type": "shared_memory"}], True)):
        with _engine_on(tiers, registry, layout) as engine:
            source = random_caches(layout, NUM_BLOCKS, seed=5)
            tokens = prompt(16)
            engine.store(tokens, source, torch.arange(16))
            frame = engine.chain.tiers[0].get([engine.chunk_keys(tokens)[0].key])[0]
            checksum = chunk_format.parse_header(frame).checksum
            assert (checksum == chunk_format.frame_checksum(memoryview(frame))) is sealed
            assert (checksum == 0) is not sealed
            target = random_caches(layout, NUM_BLOCKS, seed=6)
            assert bool(engine.retrieve(tokens, target, torch.arange(16) + 32).all())
            assert torch.equal(
                read_back(engine, source, torch.arange(16)), read_back(engine, target, torch.arange(16) + 32)
            )


def test_mask_skips_tokens_the_engine_already_has(make_engine) -> None:
    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout)
    source = random_caches(layout, NUM_BLOCKS, seed=5)
    tokens = prompt(24)
    engine.store(tokens, source, torch.arange(24))
    target = random_caches(layout, NUM_BLOCKS, seed=6)
    before = [c.clone() for c in target]
    mask = torch.tensor([False] * 10 + [True] * 14)
    loaded = engine.retrieve(tokens, target, torch.arange(24), mask)
    assert loaded.tolist() == [False] * 10 + [True] * 14
    assert torch.equal(read_back(engine, before, torch.arange(10)), read_back(engine, target, torch.arange(10)))
    assert torch.equal(read_back(engine, source, torch.arange(10, 24)), read_back(engine, target, torch.arange(10, 24)))


def test_store_with_a_mask_only_stores_new_chunks(make_engine) -> None:
    layout = LAYOUTS["sglang_mha"]
    engine = make_engine(layout)
    caches = random_caches(layout, NUM_BLOCKS)
    tokens = prompt(24)
    mask = torch.tensor([False] * 16 + [True] * 8)
    assert engine.store(tokens, caches, torch.arange(24), mask) == 8
    assert engine.lookup(tokens) == 0  # chunks 0 and 1 were never stored, so nothing is a prefix
    assert engine.store(tokens, caches, torch.arange(24)) == 16  # the stored third chunk is not stored again
    assert engine.lookup(tokens) == 24


def test_layerwise_forms_round_trip_one_layer_at_a_time(make_engine) -> None:
    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout)
    source = random_caches(layout, NUM_BLOCKS, seed=7)
    tokens = prompt(16)
    storing = engine.store_layerwise(tokens, source, torch.arange(16))
    assert [next(storing) for _ in range(layout.num_layers)] == [0, 1, 2]
    assert engine.lookup(tokens) == 0  # nothing is visible before the last layer is sealed
    with pytest.raises(StopIteration) as done:
        next(storing)
    assert done.value.value == 16 and engine.lookup(tokens) == 16

    target = random_caches(layout, NUM_BLOCKS, seed=8)
    loading = engine.retrieve_layerwise(tokens, target, torch.arange(16) + 80)
    assert loading.num_loaded_tokens == 16
    for layer in loading:
        # Layer l is complete, layers after it are untouched so far.
        assert torch.equal(source[layer].flatten(1, 2)[:, :16], target[layer].flatten(1, 2)[:, 80:96])
        for later in range(layer + 1, layout.num_layers):
            assert not torch.equal(source[later].flatten(1, 2)[:, :16], target[later].flatten(1, 2)[:, 80:96])
    assert loading.loaded_mask.all()


def test_a_layer_write_that_raises_leaves_no_token_reported_loaded(make_engine) -> None:
    """A write error other than a connector's (here a slot past the cache) goes to the caller;
    a caller that goes on must not take the mask for tokens written."""
    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout)
    tokens = prompt(16)
    engine.store(tokens, random_caches(layout, NUM_BLOCKS), torch.arange(16))
    slots = torch.arange(16)
    slots[9] = NUM_BLOCKS * layout.block_size + 3
    loading = engine.retrieve_layerwise(tokens, random_caches(layout, NUM_BLOCKS, seed=1), slots)
    assert loading.num_loaded_tokens == 16
    with pytest.raises(IndexError):
        next(loading)
    assert loading.num_loaded_tokens == 0
    assert not loading.loaded_mask.any()


def test_cache_salt_isolates_requests(make_engine) -> None:
    layout = LAYOUTS["vllm_mla"]
    engine = make_engine(layout)
    caches = random_caches(layout, NUM_BLOCKS)
    tokens = prompt(16)
    engine.store(tokens, caches, torch.arange(16), request=RequestInfo(cache_salt="tenant-a"))
    assert engine.lookup(tokens, request=RequestInfo(cache_salt="tenant-a")) == 16
    assert engine.lookup(tokens, request=RequestInfo(cache_salt="tenant-b")) == 0
    assert engine.lookup(tokens) == 0


def test_per_request_skip_save(make_engine) -> None:
    layout = LAYOUTS["vllm_mla"]
    engine = make_engine(layout)
    caches = random_caches(layout, NUM_BLOCKS)
    tokens = prompt(16)
    assert engine.store(tokens, caches, torch.arange(16), request=RequestInfo(overrides={"skip_save": True})) == 0
    assert engine.lookup(tokens) == 0


def test_vllm_cpu_layout_loads_whole_blocks_only(make_engine) -> None:
    layout = LAYOUTS["vllm_cpu"]
    engine = make_engine(layout, save_unfull_chunk=True)
    caches = random_caches(layout, NUM_BLOCKS)
    tokens = prompt(22)  # chunks of 8: two whole chunks and a 6-token tail that is not whole blocks
    assert engine.store(tokens, caches, block_slots(layout, list(range(6)), 22)) == 16
    mask = torch.tensor([False] * 5 + [True] * 17)
    loaded = engine.retrieve(
        tokens, random_caches(layout, NUM_BLOCKS), block_slots(layout, list(range(10, 16)), 22), mask
    )
    assert loaded.tolist() == [False] * 8 + [True] * 8 + [False] * 6  # starts at the next whole block


def test_bad_arguments_raise_at_once(make_engine) -> None:
    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout)
    caches = random_caches(layout, NUM_BLOCKS)
    with pytest.raises(LayoutError, match="one entry per token"):
        engine.store(prompt(8), caches, torch.arange(7))
    with pytest.raises(LayoutError, match="prefix"):
        engine.retrieve(prompt(8), caches, torch.arange(8), torch.tensor([True, False] * 4))
    with pytest.raises(LayoutError, match="layer 0"):
        engine.store(prompt(8), [c.float() for c in caches], torch.arange(8))
    with pytest.raises(LayoutError, match="expected 3 layer caches"):
        engine.store_layerwise(prompt(8), caches[:2], torch.arange(8))


class _BrokenTier(StorageTier):
    """A tier whose backing store is down: every call raises."""

    name = "broken"

    def contains(self, keys):
        raise ConnectionError("store is down")

    get = put = remove = contains

    def stats(self) -> TierStats:
        return TierStats()

    def close(self) -> None:
        pass


class _BrokenPlugin:
    from kvplug import hookimpl

    @staticmethod
    @hookimpl
    def kvplug_storage_tiers():
        return [_BrokenTier]


def test_a_failing_tier_is_a_miss_not_an_error() -> None:
    registry = PluginRegistry(plugin_filter="cpu")
    registry.register(_BrokenPlugin, "broken-test")
    config = load_config(
        engine_extra={
            "kvplug": {
                "chunk_size": 8,
                "store": {"queue": {"mode": "sync"}},
                "tiers": [{"type": "broken"}, {"type": "cpu"}],
            }
        },
        env={},
        registry=registry,
    ).config
    layout = LAYOUTS["sglang_mha"]
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry) as engine:
        caches = random_caches(layout, NUM_BLOCKS)
        tokens = prompt(16)
        engine.store(tokens, caches, torch.arange(16))
        assert engine.lookup(tokens) == 16  # served by the cpu tier behind the broken one
        assert engine.retrieve(tokens, random_caches(layout, NUM_BLOCKS), torch.arange(16)).all()
        assert engine.metrics.value("kvplug_tier_errors_total", op="contains", tier="0:broken") >= 1


def test_async_store_queue_drops_when_full_and_counts(registry) -> None:
    layout = LAYOUTS["sglang_mha"]
    config = load_config(
        engine_extra={
            "kvplug.chunk_size": 8,
            "kvplug.store": {"queue": {"mode": "async", "max_items": 1, "on_full": "drop"}},
        },
        env={},
        registry=registry,
    ).config
    engine = CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry)
    gate = threading.Event()
    original = engine.chain.put
    engine.chain.put = lambda items, **kw: (gate.wait(10), original(items, **kw))  # a slow tier, held by the test
    caches = random_caches(layout, NUM_BLOCKS)
    for i in range(4):
        engine.store(prompt(8, start=1000 * i), caches, torch.arange(8))
    gate.set()
    engine.flush()
    assert engine.metrics.value("kvplug_store_dropped_total", queue="engine") >= 1
    engine.close()


def test_close_leaves_no_thread_behind(registry) -> None:
    before = {t.name for t in threading.enumerate()}
    layout = LAYOUTS["sglang_mha"]
    config = load_config(engine_extra={"kvplug.chunk_size": 8}, env={}, registry=registry).config
    engine = CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry)
    engine.store(prompt(16), random_caches(layout, NUM_BLOCKS), torch.arange(16))
    engine.flush()
    assert engine.lookup(prompt(16)) == 16
    engine.close()
    time.sleep(0.05)
    assert {t.name for t in threading.enumerate()} <= before
    with pytest.raises(EngineClosedError):
        engine.lookup(prompt(16))


def test_connector_failures_are_misses_not_errors(make_engine) -> None:
    from kvplug.errors import PinnedPoolExhaustedError

    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout)
    caches = random_caches(layout, NUM_BLOCKS)
    tokens = prompt(16)
    real_scatter, real_gather = engine.connector.scatter_layer, engine.connector.gather_layer
    calls = {"n": 0}

    def fail_on_second_layer(cache, plan, src):
        calls["n"] += 1
        if calls["n"] == 3:  # layer 1 of two chunks: a fault a real pool can hit under load
            raise PinnedPoolExhaustedError("no staging buffer within 1 s")
        real_scatter(cache, plan, src)

    engine.connector.gather_layer = lambda *a: (_ for _ in ()).throw(PinnedPoolExhaustedError("busy"))
    assert engine.store(tokens, caches, torch.arange(16)) == 0 and engine.lookup(tokens) == 0
    engine.connector.gather_layer = real_gather
    assert engine.store(tokens, caches, torch.arange(16)) == 16
    engine.connector.scatter_layer = fail_on_second_layer
    loaded = engine.retrieve(tokens, random_caches(layout, NUM_BLOCKS), torch.arange(16) + 32)
    assert not loaded.any()
    assert engine.metrics.value("kvplug_load_errors_total", reason="PinnedPoolExhaustedError") == 2


class _WatchedTier:
    """Builds a cpu tier named ``remote`` that records the thread of every ``contains`` call."""

    calls: ClassVar[list[str]] = []

    @classmethod
    def plugin(cls):
        from kvplug import hookimpl
        from kvplug_cpu import CPUTier

        class RemoteTier(CPUTier):
            name = "remote"

            def contains(self, keys):
                cls.calls.append(threading.current_thread().name)
                return super().contains(keys)

        class Plugin:
            @staticmethod
            @hookimpl
            def kvplug_storage_tiers():
                return [RemoteTier]

        return Plugin


@pytest.mark.parametrize("queue_mode", ["async", "sync"])
def test_store_asks_only_tiers_written_on_the_callers_side_what_they_hold(queue_mode: str) -> None:
    """A store must not wait on a remote tier's round trip (S3 HEADs) just to skip a copy."""
    registry = PluginRegistry(plugin_filter="cpu")
    registry.register(_WatchedTier.plugin(), "watched-test")
    _WatchedTier.calls.clear()
    tiers = [{"type": "cpu"}, {"type": "remote", "queue": {"mode": queue_mode}}]
    config = load_config(
        engine_extra={"kvplug": {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}},
        env={},
        registry=registry,
    ).config
    layout = LAYOUTS["sglang_mha"]
    caller = threading.current_thread().name
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry) as engine:
        caches = random_caches(layout, NUM_BLOCKS)
        engine.store(prompt(16), caches, torch.arange(16))
        engine.flush()
        asked_by_caller = _WatchedTier.calls.count(caller)
        # The remote tier still checks, on its write queue's thread, before it writes: no duplicate put.
        engine.chain.put([(k.key, b"x") for k in engine.chunk_keys(prompt(16))])
        engine.flush()
        remote = dict(engine.chain.stats())["1:remote"]
    if queue_mode == "async":
        assert asked_by_caller == 0 and _WatchedTier.calls
    else:
        assert asked_by_caller >= 1  # a sync tier is written by the caller anyway: asking is as cheap
    assert remote.items == 3 and remote.puts == 3  # two chunks and the engine's fingerprint manifest


def test_a_retrieve_says_where_its_time_went(make_engine) -> None:
    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout)
    caches = random_caches(layout, NUM_BLOCKS)
    tokens = prompt(32)
    engine.store(tokens, caches, block_slots(layout, list(range(8)), 32))
    loading = engine.retrieve_layerwise(tokens, caches, block_slots(layout, list(range(8, 16)), 32))
    assert loading.timings.fetch_s > 0 and loading.timings.verify_s > 0
    assert loading.timings.write_s == 0  # nothing written yet
    next(loading)
    after_one = loading.timings.write_s
    assert after_one > 0
    loading.write_remaining()
    assert loading.timings.write_s > after_one
    assert bool(loading.loaded_mask.all())
