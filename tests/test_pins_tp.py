"""Pins across TP sizes: an engine pins the records of another TP size's writer that its loads
read (joined from smaller records, sliced from a larger one), the block-granular tail too."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import LAYOUTS, engine_maker, random_caches, rank_shard

from kvplug import CacheEngine, HeadShard, KVLayout
from kvplug.core.plugins import PluginRegistry

FULL = replace(LAYOUTS["vllm_flash"], num_kv_heads=4)
PROMPT = list(range(100, 130))  # three whole chunks of 8, then 6 tokens: the tail ends at the block end 28


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Any]:
    registry = PluginRegistry(plugin_filter="cpu,disk")
    tiers = [{"type": "disk", "path": str(tmp_path / "kv"), "max_bytes": "64KiB", "pin_max_bytes": "50%"}]
    with engine_maker(registry, tiers, block_granular_hits=True) as make:

        def rank_engine(tp_rank: int, tp_size: int) -> CacheEngine:
            heads, layout = rank_shard(FULL, tp_rank, tp_size)
            return make(layout, heads)

        yield rank_engine


def rank_caches(layout: KVLayout, first: int, seed: int) -> list[torch.Tensor]:
    return [c.narrow(3, first, layout.num_kv_heads).contiguous() for c in random_caches(FULL, 8, seed=seed)]


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2)])
def test_a_pin_pins_the_records_of_another_tp_size_that_a_load_reads(
    engines: Any, writer_tp: int, reader_tp: int
) -> None:
    for rank in range(writer_tp):
        writer = engines(rank, writer_tp)
        writer.store(PROMPT, rank_caches(writer.layout, writer.records.shard.first, 1), torch.arange(len(PROMPT)))
        writer.flush()
    reader = engines(0, reader_tp)
    assert reader.lookup(PROMPT) == 28
    report = reader.pin(PROMPT)
    # three chunks and the tail, each once however many of the writer's records it is joined from
    assert (report.chunks, report.tokens, report.refused, report.missing) == (4, 28, 0, 0)
    own = rank_caches(reader.layout, 0, 2)
    for i in range(100):  # the reader's own stores fill its tier many times over
        reader.store([50_000 + 100 * i + t for t in range(32)], own, torch.arange(32))
        reader.flush()  # a store the full queue cannot take is shed: each must land
    assert reader.lookup([50_000 + t for t in range(32)]) == 0
    assert reader.lookup(PROMPT) == 28
    released = reader.unpin(PROMPT)
    assert (released.chunks, released.tokens, released.missing) == (4, 28, 0)
    for i in range(100):
        reader.store([90_000 + 100 * i + t for t in range(32)], own, torch.arange(32))
        reader.flush()  # a store the full queue cannot take is shed: each must land
    assert reader.lookup(PROMPT) == 0


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2)])
def test_a_pin_does_not_join_another_tp_sizes_chunks_to_its_own_prefix(
    engines: Any, writer_tp: int, reader_tp: int
) -> None:
    """A load reads its prefix in one split of the heads (its own where it holds the first
    chunk), so the other size's records of a chunk after its own end are never read: not pinned,
    not counted. The tail after the prefix may be any split's."""
    for rank in range(writer_tp):
        writer = engines(rank, writer_tp)
        writer.store(PROMPT, rank_caches(writer.layout, writer.records.shard.first, 1), torch.arange(len(PROMPT)))
        writer.flush()
    reader = engines(0, reader_tp)
    reader.store(PROMPT[:16], rank_caches(reader.layout, 0, 1), torch.arange(16))  # its own chunks 0 and 1
    reader.flush()
    assert reader.lookup(PROMPT) == 16  # own chunks 0-1; chunk 2 is only the other size's
    report = reader.pin(PROMPT)
    # chunks 0-1 (its own) and the tail 24-28 (the other size's) pinned; chunk 2 missing
    assert (report.chunks, report.tokens, report.refused, report.missing) == (3, 20, 0, 1)
    released = reader.unpin(PROMPT)
    assert (released.chunks, released.missing) == (3, 1)


def test_a_pin_counts_chunks_not_the_records_of_their_head_groups() -> None:
    registry = PluginRegistry(plugin_filter="cpu,disk")
    tiers = [{"type": "cpu", "max_bytes": "64KiB", "pin_max_bytes": "50%"}]
    with engine_maker(registry, tiers, block_granular_hits=True) as make:
        engine = make(FULL, HeadShard.for_rank(total_heads=4, tp_rank=0, tp_size=1, heads_per_record=2))
        assert engine.records.count == 2  # two records per chunk
        before = engine.pin(PROMPT)
        assert (before.chunks, before.tokens, before.missing) == (0, 0, 4)
        engine.store(PROMPT, rank_caches(FULL, 0, 1), torch.arange(len(PROMPT)))
        after = engine.pin(PROMPT)
        assert (after.chunks, after.tokens, after.refused, after.missing) == (4, 28, 0, 0)
        unpinned = engine.unpin(PROMPT)
        assert (unpinned.chunks, unpinned.tokens, unpinned.bytes, unpinned.missing) == (4, 28, after.bytes, 0)
