"""An operator's pin of a prompt as this engine reads it: its own records, and where a tier
holds none of its first chunk's (or of a tail's), another TP size's split of the heads that a
load would read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.engine.head_shards import HeadRecords, OtherSplit
from kvplug.core.engine.split_lookup import OtherSplitSearch, per_chunk
from kvplug.core.keys import ChunkKey, RequestInfo
from kvplug.core.pins import PinnedChunk, pin_record_keys, pinned_chunks, unpin_record_keys
from kvplug.core.tenancy import PinReport


def pin_prompt(
    chain: TierChain,
    records: HeadRecords,
    keys: Sequence[ChunkKey],
    request: RequestInfo | None,
    *,
    prefix: int | None = None,
) -> PinReport:
    """An operator's pin of the chunks ``keys`` (the whole chunks and the tail a store writes):
    the records a load of this engine reads. A load reads its prefix (the first ``prefix`` keys,
    default all) in one split of the heads: this engine's own where a tier holds all of the first
    chunk's, else the first other TP size's split that holds it whole
    (:class:`~kvplug.core.engine.head_shards.OtherSplit`); a tail after it (the rest of ``keys``),
    this engine's records or any split's that holds it whole. This engine's records are
    remembered either way, so that they are pinned if it stores them. The report counts chunks,
    each by the records that stand for it."""
    names = [key.key for key in keys]
    prefix = len(keys) if prefix is None else prefix
    own = records.record_keys(names, request)
    pins = pin_record_keys(chain, own, requested=False)
    chunks = pinned_chunks(keys, own, records.count)
    seen = pins.held | pins.refused
    rest = [i for i, chunk in enumerate(chunks) if i >= prefix and not all(key in seen for key in chunk.records)]
    if records.others and prefix and not all(key in seen for key in chunks[0].records):
        # Another split's prefix, all of it: a load never joins two splits' chunks.
        first = OtherSplitSearch(records, chain, names[:1], request).holders([0]).get(0)
        if first is not None:
            theirs = first.split.record_keys(names[:prefix], request)
            pins.add(pin_record_keys(chain, theirs, requested=False))
            chunks[:prefix] = pinned_chunks(keys[:prefix], theirs, first.split.count)
    if rest and records.others:
        held = OtherSplitSearch(records, chain, [names[i] for i in rest], request).holders(range(len(rest)))
        tails = {rest[j]: found.split.record_keys([names[rest[j]]], request) for j, found in held.items()}
        if tails:
            pins.add(pin_record_keys(chain, [key for found in tails.values() for key in found], requested=False))
        for index, found in tails.items():  # their records stand for this engine's of that tail
            chunks[index] = replace(chunks[index], records=found)
    return pins.report(chunks)


def unpin_prompt(
    chain: TierChain,
    records: HeadRecords,
    keys: Sequence[ChunkKey],
    request: RequestInfo | None,
    also: Sequence[ChunkKey] = (),
) -> PinReport:
    """:func:`pin_prompt` reversed: this engine's records of chunks ``keys`` and every other
    split's. A chunk counts unpinned where some split's records of it were, else ``missing``;
    chunks ``also`` are unpinned too but counted only where something of them was pinned
    (a partial last chunk that this engine's stores do not write, but a request's may have)."""
    every = [*keys, *also]
    names = [key.key for key in every]
    splits: list[HeadRecords | OtherSplit] = [records, *records.others]
    theirs = [split.record_keys(names, request) for split in splits]
    pins = unpin_record_keys(chain, [key for found in theirs for key in found])
    cut = [per_chunk(found, split.count) for split, found in zip(splits, theirs)]
    chunks = [
        PinnedChunk(key.start, key.end, [record for split in cut for record in split[index]])
        for index, key in enumerate(every)
    ]
    return pins.report(chunks[: len(keys)], chunks[len(keys) :])
