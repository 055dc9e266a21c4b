"""Removing keys from a :class:`~kvplug.TierChain`'s tiers: the one way anything leaves them
on purpose (a corrupt chunk, ``store gc``, ``kvplug ctl clear``, an engine's cache reset).

An ``async`` tier's write queue may still hold a write of a key being removed, or be
writing one: removed from the tier alone, the key would come back when the queue
writes it. So a removal first cancels the queued writes of every key it means
(:meth:`RemovalPlan.cancels`), waiting for one in progress to land, and only then asks
the plan which keys to remove from each tier (:meth:`RemovalPlan.for_tier`): a plan
that reads a journal of the chain's writes then sees the writes that landed meanwhile.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvplug.core.chain.slot import TierSlot
from kvplug.core.chain.write_queue import Items
from kvplug.core.tier import Buffer


class RemovalPlan(Protocol):
    """Which keys a removal means: whose queued writes to cancel, and what to remove where."""

    def cancels(self) -> Sequence[str]:
        """The keys whose queued writes (the chain's own, not written yet) are dropped."""
        ...

    def for_tier(self, index: int, *, private: bool) -> list[str]:
        """The keys to remove from the tier at ``index`` (``private``: it has ``trusted_reads``)."""
        ...


@dataclass(frozen=True)
class RemoveKeys:
    """A plan that removes the same keys from every tier."""

    keys: Sequence[str]

    def cancels(self) -> Sequence[str]:
        return self.keys

    def for_tier(self, index: int, *, private: bool) -> list[str]:
        return list(self.keys)


@dataclass(frozen=True)
class TierRemoval:
    """What a removal did to one tier."""

    #: The tier's index and label in its chain (``1:disk``).
    index: int
    label: str
    #: The keys the tier was asked to remove (with ``count``: those it held); none if it failed.
    removed: list[str]
    #: Queued writes of planned keys dropped before they reached the tier.
    cancelled: list[str]
    #: How far the tier's ``bytes_used`` fell (with ``count``; else 0).
    bytes_freed: int = 0


def remove_planned(
    slots: Sequence[TierSlot], plan: RemovalPlan, *, tiers: Collection[int] | None = None, count: bool = False
) -> list[TierRemoval]:
    """Carry out ``plan`` on ``slots`` (only those whose index is in ``tiers``; None: all).

    ``count``: ask each tier which planned keys it holds and remove only those, and
    measure the bytes freed (what ``kvplug ctl clear`` reports); otherwise every
    planned key is passed to ``remove``, which ignores keys a tier lacks.
    """
    chosen = [slot for slot in slots if tiers is None or slot.index in tiers]
    dropped = _cancel(chosen, list(plan.cancels()))
    done: list[TierRemoval] = []
    for slot in chosen:
        keys = plan.for_tier(slot.index, private=slot.tier.trusted_reads)
        before = 0
        if count and keys:
            before = _bytes_used(slot)
            keys = [key for key, held in zip(keys, slot.stored(keys) or [False] * len(keys)) if held]
        if keys and not slot.remove(keys):
            keys = []
        freed = max(0, before - _bytes_used(slot)) if count and keys else 0
        done.append(TierRemoval(slot.index, slot.label, keys, dropped.get(slot.index, []), freed))
    return done


def remove_read(slots: Sequence[TierSlot], items: Items) -> None:
    """Remove values a load read and found unusable: the queued writes of those values are
    cancelled (a newer queued value of the key is still written), then each tier removes a key only while it still holds the value read
    (:meth:`~kvplug.StorageTier.remove_if_same`; a record tier that cannot compare and delete
    in one step: by name, if a second read still finds the value)."""
    _cancel(slots, [key for key, _ in items], only=dict(items))
    for slot in slots:
        slot.remove_if_same(items)


def _cancel(
    slots: Sequence[TierSlot], keys: list[str], *, only: Mapping[str, Buffer] | None = None
) -> dict[int, list[str]]:
    """Drop the queued writes of ``keys`` (waiting for one being written; ``only``: while the
    newest is the value given, see :meth:`WriteQueue.cancel`); per tier index, those dropped."""
    dropped: dict[int, list[str]] = {}
    for slot in slots:
        if slot.queue is None or not keys:
            continue
        # Never reported: a write that never landed was never announced stored, and an older
        # value the tier holds is reported by the tier's own removal of it.
        dropped[slot.index] = slot.queue.cancel(keys, only=only)
    return dropped


def _bytes_used(slot: TierSlot) -> int:
    stats = slot.stats()
    return 0 if stats is None else stats.bytes_used
