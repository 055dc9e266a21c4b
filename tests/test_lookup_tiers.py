"""CacheEngine.locate: the cached prefix, per chunk, with the fastest tier holding it."""

from __future__ import annotations

import pytest
import torch
from core_helpers import LAYOUTS, random_caches

from kvplug import ChunkLocation, RequestInfo, merge_locations
from kvplug.core.plugins import PluginRegistry


@pytest.fixture
def registry() -> PluginRegistry:
    """Builtins with the cpu, disk and s3 tiers (all in the core test environment)."""
    return PluginRegistry(plugin_filter="cpu,disk,s3")


def test_locate_names_the_fastest_tier_of_each_chunk(make_engine, tmp_path) -> None:
    layout = LAYOUTS["vllm_flash"]
    tiers = [{"type": "cpu", "max_bytes": "64MiB"}, {"type": "disk", "path": str(tmp_path)}]
    engine = make_engine(layout, tiers=tiers)
    caches = random_caches(layout, 80)
    tokens = list(range(100, 130))
    assert [(loc.tier, loc.tokens) for loc in engine.locate(tokens)] == []
    engine.store(tokens, caches, torch.arange(30))
    # The disk tier is written by the chain's queue: removals below must come after that write.
    engine.flush()
    assert [(loc.tier, loc.tokens) for loc in engine.locate(tokens)] == [("cpu", 8)] * 3
    cpu, disk = engine.chain.tiers
    first_key = engine.chunk_keys(tokens)[0].key
    cpu.remove([first_key])  # now only on disk: a slow hit
    assert [(loc.tier, loc.tokens) for loc in engine.locate(tokens)] == [("disk", 8), ("cpu", 8), ("cpu", 8)]
    disk.remove([first_key])
    assert [(loc.tier, loc.tokens) for loc in engine.locate(tokens)] == []
    assert engine.lookup(tokens) == 0


def test_locate_says_each_chunks_medium_and_inline_lookups_stop_at_a_slower_tier(make_engine, tmp_path) -> None:
    layout = LAYOUTS["vllm_flash"]
    tiers = [{"type": "cpu", "max_bytes": "64MiB"}, {"type": "disk", "path": str(tmp_path)}]
    engine = make_engine(layout, tiers=tiers)
    tokens = list(range(200, 230))  # 3 whole chunks of 8 and 6 tokens
    engine.store(tokens, random_caches(layout, 80), torch.arange(30))
    engine.flush()
    assert engine.locate(tokens) == [ChunkLocation("memory", "cpu", 8)] * 3
    assert engine.locate_inline(tokens) == engine.locate(tokens)  # a partial last chunk is never stored
    cpu, _ = engine.chain.tiers
    cpu.remove([engine.chunk_keys(tokens)[1].key])
    assert engine.locate(tokens)[1] == ChunkLocation("disk", "disk", 8)
    assert engine.locate_inline(tokens) == engine.locate(tokens)  # disk answers inline (inline_lookups)
    lookups = engine.metrics.lookups._value.get()
    assert engine.locate_inline(tokens, count=False) is not None
    assert engine.metrics.lookups._value.get() == lookups  # counted by the caller, if at all
    assert engine.locate_inline(list(range(900, 930))) is None  # a miss: a slower tier might hold it


def test_an_inline_lookup_does_not_hide_a_partial_chunk_a_request_stored_in_a_slower_tier(
    make_engine, tmp_path
) -> None:
    """``save_unfull_chunk`` is off for the engine but on for one request, which stores a
    prompt's partial last chunk; the cpu tier lost that record, the s3 tier (a remote one:
    it never answers inline) holds it. The inline answer must not stop at the whole chunks."""
    layout = LAYOUTS["vllm_flash"]
    tiers = [{"type": "cpu", "max_bytes": "64MiB"}, {"type": "s3", "url": f"file://{tmp_path}/objects"}]
    engine = make_engine(layout, tiers=tiers)
    tokens = list(range(300, 330))  # 3 whole chunks of 8 and 6 tokens
    partial = RequestInfo(overrides={"save_unfull_chunk": True})
    engine.store(tokens, random_caches(layout, 80), torch.arange(30), request=partial)
    engine.flush()
    everything = [ChunkLocation("memory", "cpu", 8)] * 3 + [ChunkLocation("memory", "cpu", 6)]
    assert engine.locate(tokens) == everything
    cpu, _ = engine.chain.tiers
    cpu.remove([engine.chunk_keys(tokens)[-1].key])  # evicted from memory, still in s3
    assert engine.locate(tokens)[-1] == ChunkLocation("remote", "s3", 6)
    for request in (partial, None):  # the storing request's kind, and any other
        inline = engine.locate_inline(tokens, request=request)
        assert inline is None or inline == engine.locate(tokens), inline


def test_merge_locations_keeps_the_prefix_all_ranks_hold_at_the_slowest_medium() -> None:
    cpu, disk, remote = (
        ChunkLocation("memory", "cpu", 8),
        ChunkLocation("disk", "disk", 8),
        ChunkLocation("remote", "s3", 8),
    )
    assert merge_locations([[cpu, cpu, cpu], [cpu, disk], [remote, cpu, cpu]]) == [remote, disk]
    assert merge_locations([]) == []
    assert ChunkLocation.from_json(remote.to_json()) == remote
    with pytest.raises(ValueError, match="medium"):
        ChunkLocation.from_json(["tape", "t", 8])


def test_chunk_keys_from_a_lookups_hashes_are_the_keys_hashing_gives(make_engine) -> None:
    engine = make_engine(LAYOUTS["vllm_flash"], tiers=[{"type": "cpu", "max_bytes": "64MiB"}])
    tokens = list(range(300, 330))
    engine.store(tokens, random_caches(LAYOUTS["vllm_flash"], 80), torch.arange(30))
    found = engine.locate(tokens[:24])
    hashes = [location.chunk_hash for location in found]
    assert engine.chunk_keys(tokens[:24], hashes=hashes) == engine.chunk_keys(tokens[:24])
    assert ChunkLocation.from_json(found[0].to_json()).chunk_hash == hashes[0]
    # not one hash per chunk, or not a hash: the prompt is hashed after all
    assert engine.chunk_keys(tokens, hashes=hashes) == engine.chunk_keys(tokens)
    assert engine.chunk_keys(tokens[:24], hashes=["x/y"] * 3) == engine.chunk_keys(tokens[:24])
