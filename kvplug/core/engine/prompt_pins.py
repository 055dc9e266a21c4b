"""An operator's pin of a prompt as this engine reads it: its own records, and where a tier
holds none of a chunk's, another TP size's split of the heads that a load would read."""

from __future__ import annotations

from collections.abc import Sequence

from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.engine.head_shards import HeadRecords
from kvplug.core.engine.split_lookup import OtherSplitSearch, per_chunk
from kvplug.core.keys import RequestInfo
from kvplug.core.pins import pin_keys, pin_keys_held, unpin_keys_done
from kvplug.core.tenancy import PinReport


def pin_prompt(chain: TierChain, records: HeadRecords, names: Sequence[str], request: RequestInfo | None) -> PinReport:
    """An operator's pin of the chunks ``names`` (record-0 keys: the whole chunks and the tail a
    store writes): this engine's records of each, and, for a chunk no tier holds in them, the
    records of another TP size's split of the heads where a tier holds all of that chunk's
    (:class:`~kvplug.core.engine.head_shards.OtherSplit`): those a load of this engine reads.
    This engine's records are remembered either way, so that they are pinned if it stores them.
    The report counts records; a chunk found in another split's counts its records, not ``missing``."""
    own = records.record_keys(names, request)
    report, seen = pin_keys_held(chain, own, requested=False)
    owned = per_chunk(own, records.count)
    rest = [i for i, keys in enumerate(owned) if not all(key in seen for key in keys)]
    if not rest or not records.others:
        return report
    held = OtherSplitSearch(records, chain, [names[i] for i in rest], request).holders(range(len(rest)))
    for other in records.others:
        found = [j for j in sorted(held) if held[j].split is other]
        if not found:
            continue
        extra = pin_keys(chain, other.record_keys([names[rest[j]] for j in found], request))
        # their records stand for this engine's of those chunks, which are not missing then
        unmissed = sum(1 for j in found for key in owned[rest[j]] if key not in seen)
        report = _sum(report, extra, missing=report.missing - unmissed + extra.missing)
    return report


def unpin_prompt(
    chain: TierChain, records: HeadRecords, names: Sequence[str], request: RequestInfo | None
) -> PinReport:
    """:func:`pin_prompt` reversed: this engine's records of chunks ``names`` and every other
    split's; ``missing`` counts this engine's records of the chunks no split's records of which
    were all unpinned."""
    own = records.record_keys(names, request)
    report, done = unpin_keys_done(chain, own)
    owned = per_chunk(own, records.count)
    credited = {i for i, keys in enumerate(owned) if all(key in done for key in keys)}
    for other in records.others:
        theirs = other.record_keys(names, request)
        extra, undone = unpin_keys_done(chain, theirs)
        if not undone:
            continue
        released = {i for i, keys in enumerate(per_chunk(theirs, other.count)) if all(k in undone for k in keys)}
        unmissed = sum(1 for i in released - credited for key in owned[i] if key not in done)
        report = _sum(report, extra, missing=report.missing - unmissed)
        credited |= released
    return report


def _sum(first: PinReport, second: PinReport, *, missing: int) -> PinReport:
    return PinReport(
        chunks=first.chunks + second.chunks,
        bytes=first.bytes + second.bytes,
        refused=first.refused + second.refused,
        missing=missing,
        book_full=first.book_full + second.book_full,
    )
