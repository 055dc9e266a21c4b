"""Head splits that would cut KV wrongly are refused or missed, never loaded.

A packed (``whole_blocks_only``) format whose blocks are token-major cannot be cut by KV
head: another TP size's records of it are misses. KV head counts that do not split evenly
over the TP size have no shard.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from test_head_shards import TOKENS, engines, equal, heads_of, registry, zeros_like

from kvplug import Fingerprint, HeadShard, KVLayout, PagedFormat
from kvplug.core.engine.head_shards import HeadRecords
from kvplug.errors import ConfigError

__all__ = ["engines", "registry"]  # fixtures, used by name

#: A packed format whose blocks are token-major: a block's heads are not runs of it.
TOKEN_MAJOR_PACKED = PagedFormat(
    "token_major_packed", ("block", "token", "head", "dim"), tensors=2, whole_blocks_only=True
)


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_token_major_packed_records_of_another_tp_size_are_misses(engines: Any, writer_tp: int, reader_tp: int) -> None:
    """Cut by head as if head-major, another TP size's record would load other heads' KV."""
    full = KVLayout(TOKEN_MAJOR_PACKED, num_layers=2, block_size=4, num_kv_heads=4, head_dim=8, dtype=torch.float16)
    generator = torch.Generator().manual_seed(11)
    source = [tuple(torch.randn(8, 4, 4, 8, generator=generator).half() for _ in range(2)) for _ in range(2)]
    slots = torch.arange(len(TOKENS))

    def rank_of(tp_rank: int, tp_size: int) -> tuple[HeadShard, KVLayout]:
        heads = HeadShard.for_rank(total_heads=4, tp_rank=tp_rank, tp_size=tp_size)
        return heads, replace(full, num_kv_heads=4 // tp_size)

    for rank in range(writer_tp):
        heads, layout = rank_of(rank, writer_tp)
        writer = engines(layout, heads)
        assert writer.store(TOKENS, heads_of(source, 2, heads.first, layout.num_kv_heads), slots) == len(TOKENS)
        writer.flush()
    for rank in range(reader_tp):
        heads, layout = rank_of(rank, reader_tp)
        reader = engines(layout, heads)
        target = zeros_like(heads_of(source, 2, heads.first, layout.num_kv_heads))
        assert int(reader.retrieve(TOKENS, target, slots).sum()) == 0
        assert reader.lookup(TOKENS) == 0
    # The writer's own TP size reads them, byte for byte.
    heads, layout = rank_of(0, writer_tp)
    own = heads_of(source, 2, heads.first, layout.num_kv_heads)
    target = zeros_like(own)
    assert bool(engines(layout, heads).retrieve(TOKENS, target, slots).all())
    assert equal(target, own)


def test_token_major_packed_records_hold_a_ranks_heads() -> None:
    layout = KVLayout(TOKEN_MAJOR_PACKED, num_layers=1, block_size=4, num_kv_heads=4, head_dim=8, dtype=torch.float16)
    heads = HeadShard.for_rank(total_heads=4, tp_rank=0, tp_size=1, heads_per_record=2)
    with pytest.raises(ConfigError, match="token-major"):
        HeadRecords(layout, Fingerprint.for_layout(layout, model_id="m"), heads)


@pytest.mark.parametrize(("total", "tp_size"), [(6, 4), (3, 2), (3, 4), (2, 3), (12, 8)])
def test_heads_that_do_not_split_evenly_over_tp_are_refused(total: int, tp_size: int) -> None:
    """A shard of such sizes would label its records with heads the rank does not hold."""
    for rank in range(tp_size):
        with pytest.raises(
            ValueError, match=f"{total} KV heads do not split evenly over tensor-parallel size {tp_size}"
        ):
            HeadShard.for_rank(total_heads=total, tp_rank=rank, tp_size=tp_size)
