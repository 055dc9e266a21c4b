"""One cache engine per KV cache group of a hybrid model, sharing the first one's tiers
(``CacheEngine(shares_tiers_with=)``): the vLLM adapter's SupportsHMA path."""

from __future__ import annotations

from dataclasses import replace

import torch
from core_helpers import LAYOUTS, random_caches

from kvplug import CacheEngine, Fingerprint, load_config, slots_from_block_ids
from kvplug.core.plugins import PluginRegistry
from kvplug.testing import gather_chunk

NUM_BLOCKS = 40


def read_back(engine: CacheEngine, caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    out = torch.empty(engine.layout.chunk_shape(slots.numel()), dtype=engine.layout.dtype)
    gather_chunk(engine.connector, caches, slots, out)
    return out.view(torch.uint8)


def test_group_engines_share_the_tiers_under_their_own_keys(registry: PluginRegistry) -> None:
    layout = LAYOUTS["vllm_flash"]
    extra = {"kvplug.store.queue.mode": "sync", "kvplug.chunk_size": 8}
    config = load_config(engine_extra=extra, env={}, registry=registry).config
    full = Fingerprint.for_layout(layout, model_id="m", engine_variant="kv_group=1/2:full")
    sliding = replace(full, engine_variant="kv_group=0/2:sliding16")
    owner = CacheEngine(config, layout, full, registry=registry)
    group = CacheEngine(config, layout, sliding, registry=registry, shares_tiers_with=owner)
    try:
        assert group.chain is owner.chain
        tokens = list(range(100, 132))
        slots = slots_from_block_ids(list(range(8)), layout.block_size, len(tokens))
        owner_caches = random_caches(layout, NUM_BLOCKS, seed=1)
        group_caches = random_caches(layout, NUM_BLOCKS, seed=2)
        assert owner.store(tokens, owner_caches, slots) == 32
        assert group.lookup(tokens) == 0  # the same tokens under another group's fingerprint: a miss
        assert group.store(tokens, group_caches, slots) == 32
        assert {k.key for k in owner.chunk_keys(tokens)}.isdisjoint(k.key for k in group.chunk_keys(tokens))
        # each group loads its own bytes back
        target = random_caches(layout, NUM_BLOCKS, seed=3)
        assert group.retrieve(tokens, target, slots).all()
        assert torch.equal(read_back(group, target, slots), read_back(group, group_caches, slots))
        assert not torch.equal(read_back(group, target, slots), read_back(group, owner_caches, slots))
        group.close()  # the owner's tiers stay open
        assert owner.lookup(tokens) == 32
    finally:
        group.close()
        owner.close()
