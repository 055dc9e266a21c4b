"""The cpu tier's ``eviction`` policy under a CacheEngine: a shared prefix retrieved twice
outlives a scan of one-off prompts several times the tier's budget with ``s3fifo``; with
``lru`` (the default) the scan flushes it."""

from __future__ import annotations

import pytest
import torch
from core_helpers import LAYOUTS, random_caches

NUM_BLOCKS = 80
PREFIX_TOKENS = 32  # four chunks of 8
BUDGET_CHUNKS = 12
SCAN_PROMPTS = 16  # 64 one-off chunks: over five times the budget


def prompt(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def chunk_frame_bytes(make_engine) -> int:
    engine = make_engine(LAYOUTS["vllm_flash"])
    engine.store(prompt(8, 1), random_caches(engine.layout, NUM_BLOCKS), torch.arange(8))
    (cpu,) = engine.chain.tiers
    return cpu.stats().bytes_used


@pytest.mark.parametrize(("eviction", "prefix_hit_after_scan"), [("s3fifo", PREFIX_TOKENS), ("lru", 0)])
def test_a_shared_prefix_read_twice_outlives_a_scan_of_one_off_prompts(
    make_engine, eviction: str, prefix_hit_after_scan: int
) -> None:
    frame = chunk_frame_bytes(make_engine)
    layout = LAYOUTS["vllm_flash"]
    tiers = [{"type": "cpu", "max_bytes": BUDGET_CHUNKS * frame, "eviction": eviction}]
    engine = make_engine(layout, tiers=tiers)
    caches = random_caches(layout, NUM_BLOCKS, seed=1)
    slots = torch.arange(PREFIX_TOKENS)
    shared = prompt(PREFIX_TOKENS, 1000)
    assert engine.store(shared, caches, slots) == PREFIX_TOKENS
    for _ in range(2):  # two requests hit the shared prefix
        assert engine.lookup(shared) == PREFIX_TOKENS
        assert engine.retrieve(shared, random_caches(layout, NUM_BLOCKS), slots).all()

    for i in range(SCAN_PROMPTS):  # one-off prompts, each its own chunks
        one_off = prompt(PREFIX_TOKENS, 10_000 + 1000 * i)
        assert engine.store(one_off, caches, slots) == PREFIX_TOKENS
    (cpu,) = engine.chain.tiers
    stats = cpu.stats()
    assert stats.bytes_used <= BUDGET_CHUNKS * frame and stats.evictions >= SCAN_PROMPTS * 4 - BUDGET_CHUNKS
    assert stats.extra["eviction"] == eviction

    assert engine.lookup(shared) == prefix_hit_after_scan
    if prefix_hit_after_scan:
        assert engine.retrieve(shared, random_caches(layout, NUM_BLOCKS), slots).all()
