"""Where a prompt's records are when another TP size's writer may have split the heads otherwise.

A cache engine's own records (:class:`~kvplug.core.engine.head_shards.HeadRecords`) answer first.
The other splits' records of the prompt's first chunk are asked for in the same batched
``contains`` per tier, so a reader of the writer's TP size, and a miss, cost no extra round
trip; where only another split holds the first chunk, its records of the prompt are asked for
next (:class:`~kvplug.core.engine.head_shards.OtherSplit`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvplug.core.chain.reads import leading
from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.engine.head_shards import HeadRecords, OtherSplit
from kvplug.core.keys import RequestInfo


def located_prefix(
    records: HeadRecords, chain: TierChain, keys: Sequence[str], request: RequestInfo | None, order: Sequence[str]
) -> list[str]:
    """Per chunk of the cached prefix of chunk ``keys``, the slowest tier (latest in ``order``)
    holding its records, whichever split of the heads wrote them."""
    own = records.record_keys(keys, request)
    others = _first_records(records, keys, request)
    where = chain.locate([*own, *(key for _, names in others for key in names)])
    tiers = records.chunk_tiers(leading(where[: len(own)]), order)
    if tiers or not others:
        return tiers
    other = _holder(others, where[len(own) :])
    if other is None:
        return []
    return other.chunk_tiers(chain.locate_prefix(other.record_keys(keys, request)), order)


def other_split_holding(
    records: HeadRecords, chain: TierChain, keys: Sequence[str], request: RequestInfo | None
) -> OtherSplit | None:
    """The other split of the heads whose records of the first chunk some tier holds."""
    others = _first_records(records, keys, request)
    if not others:
        return None
    present = chain.contains_any([key for _, names in others for key in names], budget_s=chain.lookup_timeout_s)
    return _holder(others, present)


def _first_records(
    records: HeadRecords, keys: Sequence[str], request: RequestInfo | None
) -> list[tuple[OtherSplit, list[str]]]:
    """Each other split of the heads with its record keys of the first chunk."""
    return [(other, other.record_keys([keys[0]], request)) for other in records.others] if keys else []


def _holder(
    others: Sequence[tuple[OtherSplit, list[str]]], where: Sequence[str | None] | Sequence[bool]
) -> OtherSplit | None:
    """The first split all of whose first-chunk records were found (``where``: per record, in order)."""
    at = 0
    for other, names in others:
        if all(where[at : at + len(names)]):
            return other
        at += len(names)
    return None
