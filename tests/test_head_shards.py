"""Records per range of KV heads (kvplug.core.engine.head_shards): engines of any TP size share chunks.

A "TP=1" engine holds all 4 KV heads of a cache; the two ranks of a "TP=2" engine hold
heads 0-1 and 2-3 (copies of the same KV, sliced as vLLM slices them). With
``heads_per_record: 2`` each side reads what the other stored, byte for byte, in every
head-bearing format (flash, vLLM's packed CPU layout, SGLang's token pool). Latent
(MLA) caches are one record for all ranks, written by rank 0 only. Chunks keyed the
old way (by TP rank and size, no head range) are misses.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import HEAD_AXIS, LAYOUTS, engine_maker, heads_of, random_caches, rank_shard

from kvplug import CacheEngine, Fingerprint, HeadShard, KVLayout, RequestInfo, load_config
from kvplug.core.engine.head_shards import HeadRecords
from kvplug.core.plugins import PluginRegistry
from kvplug.errors import ConfigError

TOKENS = list(range(100, 132))  # 4 chunks of 8 (2 blocks of 4 each)


@pytest.fixture
def registry() -> PluginRegistry:
    return PluginRegistry(plugin_filter="cpu,disk")


@pytest.fixture
def engines(registry: PluginRegistry, tmp_path: Path) -> Iterator[Any]:
    with engine_maker(registry, [{"type": "disk", "path": str(tmp_path / "kv")}]) as make:
        yield make


def blocks(layout: KVLayout) -> int:
    """Exactly the blocks of the prompt, so that a cache equal to another was loaded whole."""
    return len(TOKENS) // layout.block_size


def zeros_like(caches: list[Any]) -> list[Any]:
    return [tuple(torch.zeros_like(t) for t in c) if isinstance(c, tuple) else torch.zeros_like(c) for c in caches]


def equal(a: list[Any], b: list[Any]) -> bool:
    flat_a = [t for c in a for t in (c if isinstance(c, tuple) else (c,))]
    flat_b = [t for c in b for t in (c if isinstance(c, tuple) else (c,))]
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(flat_a, flat_b, strict=True))


def shard(tp_rank: int, tp_size: int) -> HeadShard:
    return HeadShard.for_rank(total_heads=4, tp_rank=tp_rank, tp_size=tp_size, heads_per_record=2)


@pytest.mark.parametrize("name", sorted(HEAD_AXIS))
@pytest.mark.parametrize("writer_tp", [1, 2])
def test_engines_of_another_tp_size_load_the_heads_they_hold(engines: Any, name: str, writer_tp: int) -> None:
    full = replace(LAYOUTS[name], num_kv_heads=4)
    half = replace(full, num_kv_heads=2)
    axis = HEAD_AXIS[name]
    source = random_caches(full, blocks(full), seed=5)
    slots = torch.arange(len(TOKENS))
    if writer_tp == 1:
        writer = engines(full, shard(0, 1))
        assert writer.records.count == 2
        assert writer.store(TOKENS, source, slots) == len(TOKENS)
        writer.flush()
        for rank in range(2):
            reader = engines(half, shard(rank, 2))
            assert reader.records.count == 1
            assert reader.lookup(TOKENS) == len(TOKENS)
            target = zeros_like(heads_of(source, axis, 2 * rank, 2))
            assert bool(reader.retrieve(TOKENS, target, slots).all())
            assert equal(target, heads_of(source, axis, 2 * rank, 2))
    else:
        ranks = [engines(half, shard(rank, 2)) for rank in range(2)]
        reader = engines(full, shard(0, 1))
        ranks[0].store(TOKENS, heads_of(source, axis, 0, 2), slots)
        ranks[0].flush()
        # Rank 1 has not stored yet: every chunk lacks the records of heads 2-3.
        assert reader.lookup(TOKENS) == 0
        ranks[1].store(TOKENS, heads_of(source, axis, 2, 2), slots)
        ranks[1].flush()
        assert reader.lookup(TOKENS) == len(TOKENS)
        target = zeros_like(source)
        assert bool(reader.retrieve(TOKENS, target, slots).all())
        assert equal(target, source)


def test_split_then_join_restores_the_chunk() -> None:
    layout = replace(LAYOUTS["vllm_cpu"], num_kv_heads=4)
    fingerprint = Fingerprint.for_layout(layout, model_id="m")
    records = HeadRecords(
        layout, fingerprint, HeadShard.for_rank(total_heads=4, tp_rank=0, tp_size=1, heads_per_record=1)
    )
    chunk = torch.randn(layout.chunk_shape(8)).to(layout.dtype)
    parts = [torch.empty(records.record_shape(8), dtype=layout.dtype) for _ in range(records.count)]
    records.split(chunk, parts)
    # Packed blocks are head-major: record h holds head h's run of each block.
    runs = chunk.view(2, 2, 2, 4, 4 * 8)
    assert all(torch.equal(parts[h].view(2, 2, 2, 4 * 8), runs[:, :, :, h]) for h in range(4))
    assert [f.kv_heads for f in records.fingerprints] == ["0-1/4", "1-2/4", "2-3/4", "3-4/4"]
    assert len({f.hexdigest() for f in records.fingerprints}) == 4
    joined = records.joined(parts, [8])
    assert torch.equal(joined[0], chunk)


def test_a_latent_cache_is_one_record_written_by_rank_zero(engines: Any, tmp_path: Path) -> None:
    layout = LAYOUTS["vllm_mla"]
    source = random_caches(layout, blocks(layout), seed=6)
    slots = torch.arange(len(TOKENS))
    disk = {"type": "disk", "path": str(tmp_path / "shared")}

    def rank(r: int) -> CacheEngine:
        return engines(
            layout,
            HeadShard.for_rank(total_heads=1, tp_rank=r, tp_size=2, latent=True),
            tiers=[
                {"type": "cpu"},
                disk,
            ],
        )

    second, first = rank(1), rank(0)
    assert not second.records.writer and first.records.writer
    assert second.record_keys(second.chunk_keys(TOKENS)) == first.record_keys(first.chunk_keys(TOKENS))
    second.store(TOKENS, source, slots)
    second.flush()
    shared = second.chain.tiers[1]
    keys = second.record_keys(second.chunk_keys(TOKENS))
    assert shared.contains(keys) == [False] * 4  # a replica keeps its copy in its own memory
    assert second.chain.tiers[0].contains(keys) == [True] * 4
    first.store(TOKENS, source, slots)
    first.flush()
    assert shared.contains(keys) == [True] * 4
    reader = rank(1)  # a new process of rank 1: only the shared tier holds the chunks
    target = zeros_like(source)
    assert bool(reader.retrieve(TOKENS, target, slots).all())
    assert equal(target, source)


def test_a_replicas_loads_promote_its_unchecked_copies_into_no_shared_tier(engines: Any, tmp_path: Path) -> None:
    """A replica seals its copies without a frame checksum (they never leave the process); a
    shared tier whose admission admits them on a later load must not get them from its loads
    either (``kvplug store verify`` then called them corrupt, and ``store gc`` removed them)."""
    layout = LAYOUTS["vllm_mla"]
    frequency = {"type": "frequency", "min_hits": 2}
    replica = engines(
        layout,
        HeadShard.for_rank(total_heads=1, tp_rank=1, tp_size=2, latent=True),
        tiers=[{"type": "cpu"}, {"type": "disk", "path": str(tmp_path / "shared"), "admission": frequency}],
    )
    slots = torch.arange(len(TOKENS))
    replica.store(TOKENS, random_caches(layout, blocks(layout), seed=6), slots)
    for _ in range(2):  # sightings enough for the shared tier's admission
        assert bool(replica.retrieve(TOKENS, random_caches(layout, blocks(layout)), slots).all())
    replica.flush()
    keys = replica.record_keys(replica.chunk_keys(TOKENS))
    assert replica.chain.tiers[1].contains(keys) == [False] * 4


def test_replicated_kv_heads_have_one_writer_per_head() -> None:
    shards = [HeadShard.for_rank(total_heads=2, tp_rank=r, tp_size=4) for r in range(4)]
    assert [(s.first, s.writer) for s in shards] == [(0, True), (0, False), (1, True), (1, False)]
    assert {s.label(0) for s in shards} == {"0-1/2", "1-2/2"}


def test_heads_per_record_must_divide_a_ranks_heads() -> None:
    with pytest.raises(ConfigError, match="heads_per_record.*must divide the 2 KV heads a rank holds"):
        HeadShard.for_rank(total_heads=4, tp_rank=0, tp_size=2, heads_per_record=4)


def test_chunks_keyed_by_tp_rank_and_size_are_misses(engines: Any, tmp_path: Path) -> None:
    """A chunk written before records were keyed by head range (the fingerprint had no
    ``kv_heads``, the rank's TP rank and size instead) is a miss, never misread."""
    layout = replace(LAYOUTS["vllm_flash"], num_kv_heads=4)
    source = random_caches(layout, blocks(layout), seed=7)
    slots = torch.arange(len(TOKENS))
    engine = engines(layout, HeadShard.for_rank(total_heads=4, tp_rank=0, tp_size=1))
    keys = engine.record_keys(engine.chunk_keys(TOKENS))
    # The same fingerprint as the old code computed it: no kv_heads field, tp_rank/tp_size kept.
    old_fields = asdict(replace(engine.fingerprint, kv_heads="", kv_layout=layout.describe()))
    del old_fields["kv_heads"]
    old_hex = hashlib.sha256(json.dumps(old_fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
    old_keys = [f"{engine.fingerprint.format_version}/{old_hex}/{key.rsplit('/', 1)[1]}" for key in keys]
    assert old_keys != keys
    frames = []
    for key in old_keys:
        frame, payload = engine.chunk_store.allocate(layout.chunk_shape(8), layout.dtype)
        payload.copy_(torch.randn(payload.shape).to(layout.dtype))
        frames.append((key, frame))
    engine.chunk_store.put_frames(frames)
    engine.flush()
    assert engine.chain.tiers[0].contains(old_keys) == [True] * 4
    assert engine.lookup(TOKENS) == 0
    target = zeros_like(source)
    assert not bool(engine.retrieve(TOKENS, target, slots).any())
    assert equal(target, zeros_like(source))


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_chunk_named_by_its_first_record_is_removed_whole(engines: Any, salt: str | None) -> None:
    """A reset or ``kvplug ctl clear`` knows a chunk by the key of its first record (the
    worker's index, the journal): every head group's record of it goes, salted or not."""
    layout = replace(LAYOUTS["vllm_flash"], num_kv_heads=4)
    engine = engines(layout, shard(0, 1), tiers=[{"type": "cpu", "max_bytes": "64MiB"}])
    request = RequestInfo(cache_salt=salt)
    engine.store(TOKENS, random_caches(layout, blocks(layout), seed=3), torch.arange(len(TOKENS)), request=request)
    engine.flush()
    first = [key.key for key in engine.chunk_keys(TOKENS, request)]
    records = engine.record_keys(engine.chunk_keys(TOKENS, request), request)
    assert len(records) == 2 * len(first)
    assert sorted(engine.records.all_records(first)) == sorted(records)
    assert sorted(engine.records.all_records(records)) == sorted(records)  # a journal names every record
    engine.chain.tiers[0].remove(engine.records.all_records(first))
    assert engine.chain.tiers[0].contains(records) == [False] * len(records)


@pytest.mark.parametrize("name", sorted(HEAD_AXIS))
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (8, 2), (2, 8)])
def test_default_records_are_read_by_every_tp_size(engines: Any, name: str, writer_tp: int, reader_tp: int) -> None:
    """``heads_per_record: auto`` (one record per rank): a reader of another TP size joins
    smaller records or slices a larger one into the heads it holds, byte for byte. TP 8 over
    4 KV heads replicates each head on two ranks (one writes it)."""
    full = replace(LAYOUTS[name], num_kv_heads=4)
    axis = HEAD_AXIS[name]
    source = random_caches(full, blocks(full), seed=7)
    slots = torch.arange(len(TOKENS))

    for rank in range(writer_tp):
        heads, layout = rank_shard(full, rank, writer_tp)
        writer = engines(layout, heads)
        writer.store(TOKENS, heads_of(source, axis, heads.first, layout.num_kv_heads), slots)
        writer.flush()
    for rank in range(reader_tp):
        heads, layout = rank_shard(full, rank, reader_tp)
        reader = engines(layout, heads)
        assert reader.lookup(TOKENS) == len(TOKENS), (rank, reader.records.labels)
        assert [loc.tokens for loc in reader.locate(TOKENS)] == [8, 8, 8, 8]
        own = heads_of(source, axis, heads.first, layout.num_kv_heads)
        target = zeros_like(own)
        assert bool(reader.retrieve(TOKENS, target, slots).all())
        assert equal(target, own)


def test_every_record_key_names_the_serializer(tmp_path: Path) -> None:
    """Each head group's records (and other TP sizes' splits) are keyed under the engine's
    serializer, as record 0's are: an engine of another serializer misses them and leaves
    them stored (before: records 1.. were keyed as 'raw', and a raw engine found zstd frames,
    failed to decode them and removed them)."""
    registry = PluginRegistry(plugin_filter="cpu,disk,compress")
    layout = replace(LAYOUTS["vllm_flash"], num_kv_heads=4)
    source = random_caches(layout, blocks(layout), seed=9)
    slots = torch.arange(len(TOKENS))
    heads = HeadShard.for_rank(total_heads=4, tp_rank=0, tp_size=1, heads_per_record=1)
    folder = str(tmp_path / "kv")

    def engine(serializer: str) -> CacheEngine:
        extra = {"kvplug": {"chunk_size": 8, "serializer": {"type": serializer}, "store": {"queue": {"mode": "sync"}},
                            "tiers": [{"type": "disk", "path": folder, "queue": {"mode": "sync"}}]}}  # fmt: skip
        config = load_config(engine_extra=extra, env={}, registry=registry).config
        return CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry, heads=heads)

    with engine("zstd") as zstd:
        assert {f.serializer for f in zstd.records.fingerprints} == {zstd.fingerprint.serializer}
        assert {f.serializer for other in zstd.records.others for f in other.fingerprints} == {
            zstd.fingerprint.serializer
        }
        zstd.store(TOKENS, source, slots)
        zstd.flush()
    with engine("raw") as raw:
        assert raw.lookup(TOKENS) == 0
        target = zeros_like(source)
        assert not bool(raw.retrieve(TOKENS, target, slots).any())
    with engine("zstd") as again:
        assert again.lookup(TOKENS) == len(TOKENS)


def test_a_miss_asks_each_tier_once_and_a_same_tp_hit_too(engines: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cross-TP reads cost a reader of the writer's TP size nothing in round trips: its own
    records and the other splits' first-chunk records go in one ``contains`` per tier (a remote
    tier: one round trip). Only a hit through another split asks again, for its records."""
    full = replace(LAYOUTS["vllm_flash"], num_kv_heads=4)
    half = replace(full, num_kv_heads=2)
    source = random_caches(full, blocks(full), seed=3)
    slots = torch.arange(len(TOKENS))
    tp1 = engines(full, HeadShard.for_rank(total_heads=4, tp_rank=0, tp_size=1))
    tp2 = engines(half, HeadShard.for_rank(total_heads=4, tp_rank=0, tp_size=2))
    tp1.store(TOKENS, source, slots)
    tp1.flush()
    for engine in (tp1, tp2):
        (tier,) = engine.chain.tiers
        calls: list[int] = []
        asked = tier.contains
        monkeypatch.setattr(
            tier, "contains", lambda keys, asked=asked, calls=calls: calls.append(len(keys)) or asked(keys)
        )
        engine.calls = calls  # type: ignore[attr-defined]
    assert tp1.lookup(list(range(900, 932))) == 0 and len(tp1.calls) == 1  # type: ignore[attr-defined]
    assert tp1.lookup(TOKENS) == len(TOKENS) and len(tp1.calls) == 2  # type: ignore[attr-defined]
    assert tp2.lookup(TOKENS) == len(TOKENS) and len(tp2.calls) == 2  # type: ignore[attr-defined]  # found, then asked


def test_tp_sharing_same_keeps_the_writers_tp_size_in_the_keys(registry: PluginRegistry, tmp_path: Path) -> None:
    """``tp_sharing: same``: a hit is bit for bit the KV this engine would have computed, so an
    engine of another TP size (whose own KV differs in the last bits) misses; one of the writer's
    TP size hits."""
    full = replace(LAYOUTS["vllm_flash"], num_kv_heads=4)
    half = replace(full, num_kv_heads=2)
    source = random_caches(full, blocks(full), seed=11)
    slots = torch.arange(len(TOKENS))
    extra = {"kvplug": {"chunk_size": 8, "tp_sharing": "same", "store": {"queue": {"mode": "sync"}},
                        "tiers": [{"type": "disk", "path": str(tmp_path / "kv")}]}}  # fmt: skip
    config = load_config(engine_extra=extra, env={}, registry=registry).config

    def engine(layout: KVLayout, tp_rank: int, tp_size: int) -> CacheEngine:
        fingerprint = replace(Fingerprint.for_layout(layout, model_id="m"), tp_rank=tp_rank, tp_size=tp_size)
        heads = HeadShard.for_rank(total_heads=4, tp_rank=tp_rank, tp_size=tp_size)
        return CacheEngine(config, layout, fingerprint, registry=registry, heads=heads)

    with engine(full, 0, 1) as writer:
        writer.store(TOKENS, source, slots)
        writer.flush()
        assert writer.records.others == []
    with engine(half, 0, 2) as other_size, engine(full, 0, 1) as same_size:
        assert other_size.lookup(TOKENS) == 0
        assert same_size.lookup(TOKENS) == len(TOKENS)
    # Records a TP=2 engine of the default (any) wrote: not read by a TP=1 engine of "same".
    shared = {
        "kvplug": {**extra["kvplug"], "tp_sharing": "any", "tiers": [{"type": "disk", "path": str(tmp_path / "kv2")}]}
    }
    any_config = load_config(engine_extra=shared, env={}, registry=registry).config
    for rank in range(2):
        heads = HeadShard.for_rank(total_heads=4, tp_rank=rank, tp_size=2)
        fingerprint = replace(Fingerprint.for_layout(half, model_id="m"), tp_rank=rank, tp_size=2)
        with CacheEngine(any_config, half, fingerprint, registry=registry, heads=heads) as writer:
            writer.store(TOKENS, heads_of(source, HEAD_AXIS["vllm_flash"], 2 * rank, 2), slots)
            writer.flush()
    config = load_config(
        engine_extra={"kvplug": {**shared["kvplug"], "tp_sharing": "same"}}, env={}, registry=registry
    ).config
    with engine(full, 0, 1) as strict:
        assert strict.lookup(TOKENS) == 0
