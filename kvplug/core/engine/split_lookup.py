"""Where a prompt's records are when another TP size's writer may have split the heads otherwise.

A cache engine's own records (:class:`~kvplug.core.engine.head_shards.HeadRecords`) answer first.
The other splits' first records of the chunks asked about are asked for in the same batched
``contains`` per tier (:class:`OtherSplitSearch`), so a reader of the writer's TP size, and a
miss, cost no extra round trip; where only another split holds a chunk, its other records of it
are asked for next (:class:`~kvplug.core.engine.head_shards.OtherSplit`). A lookup
(:func:`located_prefix`), a block-granular tail (:mod:`kvplug.core.engine.tails`) and a pin
(:mod:`kvplug.core.engine.prompt_pins`) search the other splits this one way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvplug.core.chain.reads import leading
from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.engine.head_shards import HeadRecords, OtherSplit
from kvplug.core.keys import RequestInfo

T = TypeVar("T")


def per_chunk(records: Sequence[T], count: int) -> list[Sequence[T]]:
    """``records`` (``count`` per chunk, chunk by chunk, as ``record_keys`` names them) cut per chunk."""
    return [records[at : at + count] for at in range(0, len(records), count)]


@dataclass(frozen=True)
class HeldRecords:
    """A chunk's records, every one held by some tier, in one split of the heads."""

    split: HeadRecords | OtherSplit
    #: Per record of the chunk, the fastest tier holding it (its label, ``TierChain.labels``).
    tiers: list[str]

    def slowest(self, order: Sequence[str]) -> str:
        """The slowest (latest in ``order``) of the tiers holding the chunk's records."""
        return self.split.chunk_tiers(self.tiers, order)[0]


def whole(split: HeadRecords | OtherSplit, tiers: Sequence[str | None]) -> HeldRecords | None:
    """A chunk's records in ``split`` as held, where some tier holds each of them (``tiers``)."""
    held = [name for name in tiers if name is not None]
    return HeldRecords(split, held) if len(held) == len(tiers) else None


class OtherSplitSearch:
    """The other splits of the heads (``records.others``, in order) searched for chunks ``names``
    (record-0 keys) where this engine's own records miss.

    One batched ``locate`` asks for ``with_keys`` (the caller's own records: :attr:`located`
    answers for them) and each other split's first record of the leading ``probed`` chunks
    (``None``: all); :meth:`holders` asks for a split's other records of a chunk only where
    its first one is held.
    """

    def __init__(
        self,
        records: HeadRecords,
        chain: TierChain,
        names: Sequence[str],
        request: RequestInfo | None,
        *,
        probed: int | None = None,
        with_keys: Sequence[str] = (),
    ) -> None:
        self.chain, self.names, self.request = chain, names, request
        self.others = records.others
        firsts = [other.record_keys(names[:probed], request)[:: other.count] for other in self.others]
        where = chain.locate_labels([*with_keys, *(key for keys in firsts for key in keys)])
        #: Per key of ``with_keys``, the label of the fastest tier holding it (None: none does).
        self.located = where[: len(with_keys)]
        self._firsts: list[Sequence[str | None]] = []
        at = len(with_keys)
        for keys in firsts:
            self._firsts.append(where[at : at + len(keys)])
            at += len(keys)

    def first_held(self, index: int) -> list[OtherSplit]:
        """The other splits whose first record of chunk ``index`` (a probed one) some tier holds."""
        return [other for other, where in zip(self.others, self._firsts) if where[index] is not None]

    def holders(self, indices: Iterable[int]) -> dict[int, HeldRecords]:
        """Per chunk of ``indices`` (probed ones) that another split holds whole, the first such
        split's records: one more ``locate`` per split whose first records of some are held and
        that has more than one record per chunk."""
        found: dict[int, HeldRecords] = {}
        todo = list(indices)
        for other, firsts in zip(self.others, self._firsts):
            asked = [index for index in todo if firsts[index] is not None]
            if not asked:
                continue
            if other.count == 1:
                where: Sequence[str | None] = [firsts[index] for index in asked]
            else:
                where = self.chain.locate_labels(
                    other.record_keys([self.names[index] for index in asked], self.request)
                )
            for index, tiers in zip(asked, per_chunk(where, other.count)):
                held = whole(other, tiers)
                if held is not None:
                    found[index] = held
            todo = [index for index in todo if index not in found]
        return found


def located_prefix(
    records: HeadRecords, chain: TierChain, keys: Sequence[str], request: RequestInfo | None, order: Sequence[str]
) -> list[str]:
    """Per chunk of the cached prefix of chunk ``keys``, the slowest tier (latest in ``order``,
    the chain's tier labels) holding its records, whichever split of the heads wrote them: this
    engine's own where it holds the first chunk, else the first other split whose records hold it."""
    own = records.record_keys(keys, request)
    search = OtherSplitSearch(records, chain, keys, request, probed=1, with_keys=own)
    tiers = records.chunk_tiers(leading(search.located), order)
    if tiers or not keys:
        return tiers
    for other in search.first_held(0):
        tiers = other.chunk_tiers(leading(chain.locate_labels(other.record_keys(keys, request))), order)
        if tiers:
            return tiers
    return []


def other_split_holding(
    records: HeadRecords, chain: TierChain, keys: Sequence[str], request: RequestInfo | None
) -> OtherSplit | None:
    """The first other split of the heads whose records of the first chunk some tier holds (one
    batched ``contains`` per tier within the lookup budget: a load asks only where its own missed)."""
    if not keys or not records.others:
        return None
    asked = [(other, other.record_keys([keys[0]], request)) for other in records.others]
    present = chain.contains_any([key for _, names in asked for key in names], budget_s=chain.lookup_timeout_s)
    at = 0
    for other, names in asked:
        if all(present[at : at + len(names)]):
            return other
        at += len(names)
    return None
