"""``TierRoundTripContract``: an engine's KV through a plugin's shared tier, end to end.

A tier's own conformance (:class:`~kvplug.testing.StorageTierContract`) checks bytes; this
suite checks what an engine gets from it, the way an operator uses a shared tier: a
:class:`~kvplug.CacheEngine` with tiers ``[cpu, <your tier>]`` stores a prompt, and a second
engine (empty cpu tier, same store) finds all of it in your tier, loads KV identical bit for
bit, and promotes it to cpu, which serves the next load. Subclass it in your tests with a
fixture giving the tier's config entry on a fresh store location::

    class TestMyTierRoundTrip(TierRoundTripContract):
        plugins = "cpu,mytier"

        @pytest.fixture
        def tier_entry(self, my_server) -> dict[str, Any]:
            return {"type": "mytier", "url": my_server.url, "prefix": fresh_prefix()}

Needs torch (the engine does; the tier does not).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from kvplug.core.config.loader import load_config
from kvplug.core.engine.cache_engine import CacheEngine
from kvplug.core.keys import Fingerprint
from kvplug.core.layouts import KVLayout, PagedFormat
from kvplug.core.plugins import PluginRegistry
from kvplug.testing.connector_copies import gather_chunk

#: A vLLM-like paged layout (same name: same fingerprints as the adapters').
LAYOUT = KVLayout(
    PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim")),
    num_layers=3,
    block_size=4,
    num_kv_heads=2,
    head_dim=8,
    dtype=torch.bfloat16,
)
NUM_BLOCKS = 24
TOKENS = list(range(1000, 1040))  # five chunks of 8


def caches(seed: int) -> list[torch.Tensor]:
    """Random paged caches of :data:`LAYOUT`, one per layer."""
    generator = torch.Generator().manual_seed(seed)
    shape = LAYOUT.cache_shape(NUM_BLOCKS)
    return [torch.randn(*shape, generator=generator).to(LAYOUT.dtype) for _ in range(LAYOUT.num_layers)]


class TierRoundTripContract:
    """KV through ``[cpu, tier]``: stored by one engine, found, loaded exactly and promoted
    to cpu by a second. Subclass with a ``tier_entry`` fixture and ``plugins``."""

    #: The plugins the engines load (``PluginRegistry(plugin_filter=...)``): cpu and yours.
    plugins: ClassVar[str]

    @pytest.fixture
    def tier_entry(self) -> dict[str, Any]:
        """The tier's config entry (``{"type": ..., ...}``) on a store no other test uses."""
        raise NotImplementedError

    def engine(self, entry: dict[str, Any]) -> CacheEngine:
        registry = PluginRegistry(plugin_filter=self.plugins)
        extra = {
            "kvplug.chunk_size": 8,
            "kvplug.store.queue.mode": "sync",
            # What is stored and found, not the lookup budget: a loaded machine must not
            # turn a slow answer into a miss.
            "kvplug.lookup_budget_s": 30.0,
            "kvplug.tiers": [{"type": "cpu", "max_bytes": "64MiB"}, entry],
        }
        config = load_config(engine_extra=extra, env={}, registry=registry).config
        return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="round-trip"), registry=registry)

    @staticmethod
    def gathered(engine: CacheEngine, kv: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        out = torch.empty(engine.layout.chunk_shape(slots.numel()), dtype=LAYOUT.dtype)
        gather_chunk(engine.connector, kv, slots, out)
        return out.view(torch.uint8)

    @staticmethod
    def tier_stats(engine: CacheEngine) -> dict[str, Any]:
        return {label.split(":", 1)[1]: stats for label, stats in engine.chain.stats()}

    def test_kv_round_trips_through_the_tier_and_promotes_to_cpu(self, tier_entry: dict[str, Any]) -> None:
        kind = tier_entry["type"]
        source, src_slots = caches(1), torch.randperm(NUM_BLOCKS * 4)[:40]
        with self.engine(tier_entry) as first:
            assert first.store(TOKENS, source, src_slots) == 40
            first.flush()  # a shared tier is written by its async writer
            stats = self.tier_stats(first)
            assert stats[kind].puts == 6 and stats["cpu"].items == 6  # 5 chunks and the fingerprint manifest

        with self.engine(tier_entry) as second:  # a fresh process-like engine: empty cpu tier, same store
            assert self.tier_stats(second)["cpu"].items == 0
            assert second.lookup(TOKENS) == 40
            target, dst_slots = caches(2), torch.randperm(NUM_BLOCKS * 4)[:40]
            assert bool(second.retrieve(TOKENS, target, dst_slots).all())
            assert torch.equal(self.gathered(second, source, src_slots), self.gathered(second, target, dst_slots))
            second.flush()
            stats = self.tier_stats(second)
            assert stats[kind].hits == 5 and stats["cpu"].items == 5  # promoted
            again = caches(3)
            assert bool(second.retrieve(TOKENS, again, dst_slots).all())
            assert self.tier_stats(second)[kind].hits == 5  # served by cpu this time
            assert torch.equal(self.gathered(second, source, src_slots), self.gathered(second, again, dst_slots))
