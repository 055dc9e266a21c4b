"""Tier ``shm`` as installed: named in a config and used by CacheEngines sharing its folder."""

from __future__ import annotations

from pathlib import Path

import torch
from test_disk_engine import LAYOUT, NUM_BLOCKS, kv_at, paged_caches

from kvplug import CacheEngine, Fingerprint, is_mapped_file, load_config


def engine_on(tiers: list[dict[str, object]]) -> CacheEngine:
    config = load_config(
        engine_extra={"kvplug": {"chunk_size": 16, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}, env={}
    ).config
    return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="test-model"))


def test_an_engine_loads_kv_another_stored_in_shm_and_promotes_it_to_cpu(shm_dir: Path) -> None:
    shm = {"type": "shm", "path": str(shm_dir / "kv"), "max_bytes": "64MiB"}
    tokens = list(range(48))  # three whole chunks of 16
    source = paged_caches()
    slots = torch.randperm(NUM_BLOCKS * 8)[:48]
    with engine_on([shm]) as first:
        assert first.store(tokens, source, slots) == 48
        first.flush()
    assert len(list((shm_dir / "kv").glob("*/*.kvr"))) == 4  # three chunks and the fingerprint manifest

    with engine_on([{"type": "cpu"}, shm]) as second:
        cpu, shared = second.chain.tiers
        assert shared.name == "shm" and shared.medium == "memory"
        assert second.lookup(tokens) == 48
        target = paged_caches()
        target_slots = torch.randperm(NUM_BLOCKS * 8)[:48]
        assert int(second.retrieve(tokens, target, target_slots).sum()) == 48
        for want, got in zip(kv_at(source, slots), kv_at(target, target_slots)):
            assert torch.equal(want, got)
        assert shared.stats().hits == 3 and shared.stats().extra["map_fallbacks"] == 0
        assert cpu.stats().items == 3  # promoted
        # ... as copies: a view of a record's mapping would keep its pages after an eviction
        promoted = cpu.get([chunk.key for chunk in second.chunk_keys(tokens)])
        assert all(value is not None and not is_mapped_file(value) for value in promoted)
