"""Hits granular to the engine's block: a prompt's tail stored in whole blocks.

Chunks are the unit of storage (a few hundred tokens: cheap keys and large transfers), but
an engine's own prefix cache hits to its block (16-32 tokens). With ``block_granular_hits``,
a store also keeps the tokens of the prompt past its last whole chunk, cut at its last
whole block, as one partial chunk (the *tail*: keyed as :meth:`KeyBuilder.keys` keys the
last chunk of ``tokens[:cut]``, so chunk keys stay what they are). A lookup whose prefix
stops inside a chunk then asks, in one batched ``contains`` per tier, for that chunk cut at
each block end, and the longest held is the hit's last chunk. A later request that extends
a stored prompt (the next round of a conversation) recomputes less than a block of it
instead of up to a chunk. One tail per store, at the prompt's end: a partial chunk is stored
again whole once a later request computes it. A tail is stored as whole chunks are (one record
per head group, keyed by head range), so an engine of another TP size reads it as it reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.engine.head_shards import HeadRecords, OtherSplit
from kvplug.core.engine.split_lookup import OtherSplitSearch, per_chunk, whole
from kvplug.core.keys import ChunkKey, RequestInfo


def tail_lengths(start: int, available: int, block_size: int) -> list[int]:
    """The token counts ``n < available`` at which the chunk starting at token ``start`` is cut
    at a block end (``start + n`` a multiple of ``block_size``), longest first."""
    first_end = start // block_size * block_size + block_size
    return [end - start for end in range(first_end, start + available, block_size)][::-1]


def tail_cut(num_tokens: int, chunk_size: int, block_size: int) -> int:
    """Where a store of ``num_tokens`` cuts its tail: the last block end, when it is inside a
    chunk (0: the prompt ends no block past its last whole chunk, there is no tail)."""
    cut = num_tokens // block_size * block_size
    return cut if cut > num_tokens // chunk_size * chunk_size else 0


@dataclass(frozen=True)
class HeldTail:
    """A stored tail: its key, the slowest tier holding one of its records (its label,
    ``TierChain.labels``), and the split of the heads whose records hold it (the engine's
    own, or another TP size's writer's)."""

    key: ChunkKey
    tier: str
    split: HeadRecords | OtherSplit


def longest_held_tail(
    records: HeadRecords,
    chain: TierChain,
    candidates: Sequence[ChunkKey],
    request: RequestInfo | None,
    order: Sequence[str],
) -> HeldTail | None:
    """The longest of ``candidates`` (longest first) whose records some tier holds, in the
    engine's own split of the heads or, as whole chunks are found, in another TP size's
    (:class:`~kvplug.core.engine.split_lookup.OtherSplitSearch`: its own records and each other
    split's first record of every candidate in one batched ``contains`` per tier, and another
    split's other records only where its first one is held)."""
    if not candidates:
        return None
    names = [candidate.key for candidate in candidates]
    search = OtherSplitSearch(records, chain, names, request, with_keys=records.record_keys(names, request))
    owned = per_chunk(search.located, records.count)
    for index, candidate in enumerate(candidates):
        held = whole(records, owned[index]) or search.holders([index]).get(index)
        if held is not None:
            return HeldTail(candidate, held.slowest(order), held.split)
    return None
