"""An operator's pin of a prompt as this engine reads it: its own records, and where a tier
holds none of a chunk's, another TP size's split of the heads that a load would read."""

from __future__ import annotations

from collections.abc import Sequence

from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.engine.head_shards import HeadRecords
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
    count = records.count
    rest = [i for i in range(len(names)) if not all(key in seen for key in own[i * count : (i + 1) * count])]
    for other in records.others:
        if not rest:
            break
        theirs = other.record_keys([names[i] for i in rest], request)
        where, per = chain.locate(theirs), other.count
        found = [j for j in range(len(rest)) if all(name is not None for name in where[j * per : (j + 1) * per])]
        if not found:
            continue
        extra = pin_keys(chain, [key for j in found for key in theirs[j * per : (j + 1) * per]])
        # their records stand for this engine's of those chunks, which are not missing then
        unmissed = sum(1 for j in found for key in own[rest[j] * count : (rest[j] + 1) * count] if key not in seen)
        report = _sum(report, extra, missing=report.missing - unmissed + extra.missing)
        taken = set(found)
        rest = [index for j, index in enumerate(rest) if j not in taken]
    return report


def unpin_prompt(
    chain: TierChain, records: HeadRecords, names: Sequence[str], request: RequestInfo | None
) -> PinReport:
    """:func:`pin_prompt` reversed: this engine's records of chunks ``names`` and every other
    split's; ``missing`` counts this engine's records of the chunks no split's records of which
    were all unpinned."""
    own = records.record_keys(names, request)
    report, done = unpin_keys_done(chain, own)
    count = records.count
    credited = {i for i in range(len(names)) if all(k in done for k in own[i * count : (i + 1) * count])}
    for other in records.others:
        theirs, per = other.record_keys(names, request), other.count
        extra, undone = unpin_keys_done(chain, theirs)
        if not undone:
            continue
        whole = {i for i in range(len(names)) if all(k in undone for k in theirs[i * per : (i + 1) * per])} - credited
        unmissed = sum(1 for i in whole for key in own[i * count : (i + 1) * count] if key not in done)
        report = _sum(report, extra, missing=report.missing - unmissed)
        credited |= whole
    return report


def _sum(first: PinReport, second: PinReport, *, missing: int) -> PinReport:
    return PinReport(
        chunks=first.chunks + second.chunks,
        bytes=first.bytes + second.bytes,
        refused=first.refused + second.refused,
        missing=missing,
        book_full=first.book_full + second.book_full,
    )
