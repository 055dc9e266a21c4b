"""A load that finds an unusable chunk reports its miss at once: removing the chunk from the
tiers (a remote one may hang) is the store worker's work, in order with the stores."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from core_helpers import LAYOUTS, random_caches

from kvplug import CacheEngine, Fingerprint, hookimpl, load_config
from kvplug.core.plugins import PluginRegistry
from kvplug.testing import gather_chunk

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

    class Plugin:
        @staticmethod
        @hookimpl
        def kvplug_storage_tiers() -> list[type]:
            return [SharedMemoryTier, HungRemoveTier]

    return Plugin


def test_a_corrupt_chunk_is_a_miss_at_once_while_a_tier_hangs_removing_it() -> None:
    release, removing, removed = threading.Event(), threading.Event(), []
    registry = PluginRegistry(plugin_filter="cpu")
    registry.register(_plugin(release, removing, removed), "hung-remove-test")
    layout = LAYOUTS["vllm_flash"]
    tiers = [{"type": "shared_memory"}, {"type": "hung_remove"}]
    settings = {"chunk_size": 8, "store": {"queue": {"mode": "async"}}, "tiers": tiers}
    config = load_config(engine_extra={"kvplug": settings}, env={}, registry=registry).config
    engine = CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry)
    try:
        source = random_caches(layout, NUM_BLOCKS, seed=3)
        tokens = list(range(100, 132))
        assert engine.store(tokens, source, torch.arange(32)) == 32
        engine.flush()
        key = engine.chunk_keys(tokens)[2].key
        fast = engine.chain.tiers[0]
        damaged = bytearray(fast.get([key])[0])
        damaged[-3] ^= 0x10
        fast.put([(key, bytes(damaged))])
        slow = engine.chain.tiers[1]
        super(type(slow), slow).remove([key])  # only the fast tier holds it: a load reads the corrupt copy

        results: list[torch.Tensor] = []
        target = random_caches(layout, NUM_BLOCKS, seed=4)
        loading = threading.Thread(target=lambda: results.append(engine.retrieve(tokens, target, torch.arange(32))))
        loading.start()
        assert removing.wait(WAIT_S)  # the removal began (and hangs in the slow tier)
        loading.join(WAIT_S)
        hung = loading.is_alive()
        if hung:
            release.set()  # the old way: the load waits for the remove; nothing waits for ever
            loading.join(WAIT_S)
        assert not hung, "the load waited for the tier's remove"
        assert results[0].tolist() == [True] * 16 + [False] * 16

        # A store made after the load, while the removal still hangs, lands after it: kept.
        assert engine.lookup(tokens) == 16
        assert engine.store(tokens, source, torch.arange(32)) == 8
        release.set()
        engine.flush()
        assert removed == [key]
        assert engine.lookup(tokens) == 32
        again = random_caches(layout, NUM_BLOCKS, seed=5)
        assert engine.retrieve(tokens, again, torch.arange(32)).all()
        assert torch.equal(_read(engine, source).view(torch.uint8), _read(engine, again).view(torch.uint8))
    finally:
        release.set()
        engine.close()
