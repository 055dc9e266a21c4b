"""What a chain's tiers hold and return: one batched ``contains`` or ``get`` per tier,
fastest first, each asking only the keys no faster tier answered."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvplug.core.chain.slot import TierSlot
from kvplug.core.metrics import EngineMetrics
from kvplug.core.remote.calls import call_budget, remaining_budget_s
from kvplug.core.tier import Buffer

_Where = TypeVar("_Where", str, int)


@dataclass(frozen=True)
class Fetched:
    """A value :meth:`TierChain.fetch_prefix` found, and where."""

    value: Buffer
    #: Index of the tier that answered, fastest first.
    tier: int
    #: That tier has ``trusted_reads`` (the value is this process's own bytes) or
    #: ``verified_reads`` (it checked every byte against the checksum stored with them):
    #: the frame's own checksum need not be checked again.
    trusted: bool


def holders(
    slots: Sequence[TierSlot],
    keys: Sequence[str],
    metrics: EngineMetrics,
    *,
    budget_s: float | None,
    skip: Callable[[TierSlot], bool] | None = None,
) -> list[int | None]:
    """Index of the fastest tier holding each key (None: no tier asked holds it).

    ``budget_s`` bounds the whole answer: remote tiers end their calls within it
    (:func:`kvplug.core.remote.calls.call_budget`), and tiers not asked before it ran out
    count as not holding the key. ``skip``: tiers not to ask."""
    where: list[int | None] = [None] * len(keys)
    with call_budget(budget_s):
        for slot in slots:
            if skip is not None and skip(slot):
                continue
            ask = [i for i, found in enumerate(where) if found is None]
            if not ask or _budget_spent(metrics):
                break
            answers = slot.contains([keys[i] for i in ask]) or [False] * len(ask)
            for i, found in zip(ask, answers):
                if found:
                    where[i] = slot.index
    return where


def _budget_spent(metrics: EngineMetrics) -> bool:
    remaining = remaining_budget_s()
    if remaining is None or remaining > 0:
        return False
    metrics.lookup_budget_spent.inc()
    return True


def fetch_prefix(slots: Sequence[TierSlot], keys: Sequence[str]) -> list[Fetched]:
    """See :meth:`TierChain.fetch_prefix`."""
    values: list[Buffer | None] = [None] * len(keys)
    found_in: list[int] = [-1] * len(keys)
    for slot in slots:
        ask = [i for i, value in enumerate(values) if value is None]
        if not ask:
            break
        answers = slot.get([keys[i] for i in ask]) or [None] * len(ask)
        for i, value in zip(ask, answers):
            if value is not None:
                values[i], found_in[i] = value, slot.index
    limit = next((i for i, value in enumerate(values) if value is None), len(keys))
    return [
        Fetched(value, where, slots[where].tier.trusted_reads or slots[where].tier.verified_reads)
        for value, where in zip(values[:limit], found_in[:limit])
        if value is not None
    ]


def leading(where: Sequence[_Where | None]) -> list[_Where]:
    """The tiers (names, labels or indices) of :meth:`TierChain.locate`'s answer, or of its
    kin, up to its first key no tier holds."""
    limit = next((i for i, tier in enumerate(where) if tier is None), len(where))
    return [tier for tier in where[:limit] if tier is not None]
