"""Block-granular tails (``block_granular_hits``) across TP sizes: an engine of another TP size
sharing the store hits a prompt's tail as it hits its whole chunks, and loads exactly the KV
the writer computed (joined from smaller records, sliced from a larger one, replicated heads,
MLA's one latent record)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import HEAD_AXIS, LAYOUTS, engine_maker, heads_of, random_caches, rank_shard

from kvplug import HeadShard
from kvplug.core.plugins import PluginRegistry

#: The axis of each format's per-layer tensor that holds blocks.
BLOCK_AXIS = {"vllm_flash": 1, "vllm_cpu": 0, "sglang_mha": 0, "vllm_mla": 0}
PROMPT = list(range(100, 123))  # two whole chunks of 8, then 7 tokens: the tail cut at the last block end
LONGER = [*PROMPT, 7, 8, 9]  # the next round of the conversation


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Any]:
    registry = PluginRegistry(plugin_filter="cpu,disk")
    tiers = [{"type": "disk", "path": str(tmp_path / "kv")}]
    with engine_maker(registry, tiers, block_granular_hits=True) as make:
        yield make


def blocks_of(caches: list[Any], axis: int, count: int) -> list[Any]:
    """The first ``count`` blocks of each cache tensor."""
    return heads_of(caches, axis, 0, count)


def zeros_like(caches: list[Any]) -> list[Any]:
    return [tuple(torch.zeros_like(t) for t in c) if isinstance(c, tuple) else torch.zeros_like(c) for c in caches]


def flat(caches: list[Any]) -> list[torch.Tensor]:
    return [t for c in caches for t in (c if isinstance(c, tuple) else (c,))]


def bitwise_equal(a: list[Any], b: list[Any]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(flat(a), flat(b), strict=True))


@pytest.mark.parametrize("name", sorted(HEAD_AXIS))
@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 2), (2, 1), (4, 1), (1, 4), (8, 2), (2, 8)])
def test_a_tail_another_tp_size_stored_hits_and_loads_bit_for_bit(
    engines: Any, name: str, writer_tp: int, reader_tp: int
) -> None:
    """TP 8 over 4 KV heads replicates each head on two ranks (the even one writes it)."""
    full = replace(LAYOUTS[name], num_kv_heads=4)
    size = full.block_size
    cut = len(PROMPT) // size * size  # the tail's end (20 for blocks of 4, 23 for SGLang's 1)
    num_blocks = -(-len(LONGER) // size)
    axis, block_axis = HEAD_AXIS[name], BLOCK_AXIS[name]
    source = random_caches(full, num_blocks, seed=11)

    for rank in range(writer_tp):
        heads, layout = rank_shard(full, rank, writer_tp)
        writer = engines(layout, heads)
        writer.store(PROMPT, heads_of(source, axis, heads.first, layout.num_kv_heads), torch.arange(len(PROMPT)))
        writer.flush()
        assert writer.lookup(LONGER) == cut  # its own tail
    for rank in range(reader_tp):
        heads, layout = rank_shard(full, rank, reader_tp)
        reader = engines(layout, heads)
        assert [loc.tokens for loc in reader.locate(LONGER)] == [8, 8, cut - 16], (rank, reader_tp)
        own = heads_of(source, axis, heads.first, layout.num_kv_heads)
        target = zeros_like(own)
        loaded = reader.retrieve(LONGER, target, torch.arange(len(LONGER)))
        assert loaded.tolist() == [True] * cut + [False] * (len(LONGER) - cut)
        held = cut // size
        assert bitwise_equal(blocks_of(target, block_axis, held), blocks_of(own, block_axis, held))
        assert not any(t.narrow(block_axis, held, num_blocks - held).any() for t in flat(target))


def test_a_tail_one_head_group_of_another_tp_size_lacks_is_a_miss(engines: Any) -> None:
    """Rank 1 of a TP=2 writer has not stored: a TP=1 reader holds no tail (not half of one)."""
    full = replace(LAYOUTS["vllm_flash"], num_kv_heads=4)
    source = random_caches(full, 7, seed=3)
    half = replace(full, num_kv_heads=2)
    writer = engines(half, HeadShard.for_rank(total_heads=4, tp_rank=0, tp_size=2))
    writer.store(PROMPT, heads_of(source, HEAD_AXIS["vllm_flash"], 0, 2), torch.arange(len(PROMPT)))
    writer.flush()
    reader = engines(full, HeadShard.for_rank(total_heads=4, tp_rank=0, tp_size=1))
    assert reader.lookup(LONGER) == 0
    target = zeros_like(source)
    assert not bool(reader.retrieve(LONGER, target, torch.arange(len(LONGER))).any())


def test_a_latent_tail_is_read_by_every_rank(engines: Any) -> None:
    """MLA: one record for all ranks, written by rank 0 of any TP size."""
    layout = LAYOUTS["vllm_mla"]
    cut = len(PROMPT) // layout.block_size * layout.block_size
    source = random_caches(layout, 7, seed=5)
    writer = engines(layout, HeadShard.for_rank(total_heads=1, tp_rank=0, tp_size=2, latent=True))
    writer.store(PROMPT, source, torch.arange(len(PROMPT)))
    writer.flush()
    for rank in range(4):
        reader = engines(layout, HeadShard.for_rank(total_heads=1, tp_rank=rank, tp_size=4, latent=True))
        assert reader.lookup(LONGER) == cut
        target = zeros_like(source)
        assert reader.retrieve(LONGER, target, torch.arange(len(LONGER))).tolist() == [True] * cut + [False] * 6
        assert bitwise_equal(blocks_of(target, 0, cut // 4), blocks_of(source, 0, cut // 4))
