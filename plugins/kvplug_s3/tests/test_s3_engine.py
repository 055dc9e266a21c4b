"""A CacheEngine with tiers [cpu, s3] on a real S3 server: exact KV round trips,
and a second engine (empty cpu tier) hits from S3 and promotes to cpu."""

from __future__ import annotations

import torch  # the engine needs torch; the tier itself does not
from s3_helpers import s3_options

from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, PluginRegistry, load_config
from kvplug.testing import gather_chunk

#: The engine format this test's caches use, as the vLLM/SGLang adapters declare it (same name: same fingerprints).
VLLM_FLASH = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))

LAYOUT = KVLayout(VLLM_FLASH, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
NUM_BLOCKS = 24


def caches(seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, 4, 2, 8, generator=generator).to(torch.bfloat16) for _ in range(3)]


def engine_for(s3: dict) -> CacheEngine:
    registry = PluginRegistry(plugin_filter="cpu,s3")
    extra = {
        "kvplug.chunk_size": 8,
        "kvplug.store.queue.mode": "sync",
        # These tests check what is stored and found, not the lookup budget: a
        # loaded CI machine must not turn a slow moto answer into a miss.
        "kvplug.lookup_budget_s": 30.0,
        "kvplug.tiers": [{"type": "cpu", "max_bytes": "64MiB"}, {"type": "s3", **s3}],
    }
    config = load_config(engine_extra=extra, env={}, registry=registry).config
    return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="s3-test"), registry=registry)


def gathered(engine: CacheEngine, kv: list, slots: torch.Tensor) -> torch.Tensor:
    out = torch.empty(engine.layout.chunk_shape(slots.numel()), dtype=LAYOUT.dtype)
    gather_chunk(engine.connector, kv, slots, out)
    return out.view(torch.uint8)


def tier_stats(engine: CacheEngine) -> dict:
    return {label.split(":", 1)[1]: stats for label, stats in engine.chain.stats()}


def test_kv_round_trips_through_s3_and_promotes_to_cpu(moto_s3) -> None:
    s3 = s3_options(moto_s3.endpoint)
    tokens = list(range(1000, 1040))
    source, src_slots = caches(1), torch.randperm(NUM_BLOCKS * 4)[:40]

    first = engine_for(s3)
    try:
        assert first.store(tokens, source, src_slots) == 40
        first.flush()  # the s3 tier is written by its async writer
        stats = tier_stats(first)
        assert stats["s3"].puts == 6 and stats["cpu"].items == 6  # 5 chunks and the fingerprint manifest
    finally:
        first.close()

    second = engine_for(s3)  # a fresh process-like engine: empty cpu tier, same bucket prefix
    try:
        assert tier_stats(second)["cpu"].items == 0
        assert second.lookup(tokens) == 40
        target, dst_slots = caches(2), torch.randperm(NUM_BLOCKS * 4)[:40]
        loaded = second.retrieve(tokens, target, dst_slots)
        assert bool(loaded.all())
        assert torch.equal(gathered(second, source, src_slots), gathered(second, target, dst_slots))
        second.flush()
        stats = tier_stats(second)
        assert stats["s3"].hits == 5 and stats["cpu"].items == 5  # promoted
        again = caches(3)
        assert bool(second.retrieve(tokens, again, dst_slots).all())
        assert tier_stats(second)["s3"].hits == 5  # served by cpu this time
        assert torch.equal(gathered(second, source, src_slots), gathered(second, again, dst_slots))
    finally:
        second.close()
