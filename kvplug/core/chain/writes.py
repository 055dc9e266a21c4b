"""What a chain writes to its tiers: each tier's admission policy picks the chunks of a
``put`` or a ``promote`` it takes, before the write is made (``queue.mode: sync``) or
queued (``async``); a tier is written only the keys it lacks. Stores and verified loads
count as sightings, lookups do not; a load also writes to a slower tier the chunks its
policy has just admitted (declined when stored): see :mod:`kvplug.core.policies.admission`."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvplug.core.chain.reads import Fetched
from kvplug.core.chain.slot import TierSlot
from kvplug.core.chain.write_queue import Items


def write_put(
    slots: Sequence[TierSlot], items: Items, *, admission: bool, only_trusted: bool, skip: Collection[int] = ()
) -> None:
    """See :meth:`TierChain.put` (``skip``: indexes of tiers not to write)."""
    if not items:
        return
    if admission:
        _seen(slots, [key for key, _ in items])
    for slot in slots:
        if (only_trusted and not slot.tier.trusted_reads) or slot.index in skip:
            continue
        _write_missing(slot, _admitted(slot, items) if admission else items)


def write_promoted(
    slots: Sequence[TierSlot], keys: list[str], fetched: Sequence[Fetched], *, only_trusted: bool
) -> None:
    """See :meth:`TierChain.promote` (``keys``: one per value ``fetched``, at least one)."""
    selective = [slot for slot in slots if not slot.admission.admits_everything]
    before = {id(slot): slot.admission.admit(keys) for slot in selective}
    _seen(slots, keys)
    for index, slot in enumerate(slots):
        if only_trusted and not slot.tier.trusted_reads:
            continue
        faster = [(key, hit.value) for key, hit in zip(keys, fetched) if hit.tier > index]
        admitted = _admitted(slot, faster)
        if admitted:
            slot.metrics.promotions.labels(slot.label).inc(len(admitted))
            _write(slot, admitted)
        if id(slot) in before:
            _catch_up(slot, keys, fetched, index, before[id(slot)])


def _write_missing(slot: TierSlot, items: Items) -> None:
    if not items:
        return
    if slot.queue is not None:  # a slow tier checks what it lacks on its queue's thread
        slot.queue.submit(items)
    else:
        put_missing(slot, items)
        slot.settle()


def _seen(slots: Sequence[TierSlot], keys: list[str]) -> None:
    for slot in slots:
        if not slot.admission.admits_everything:
            slot.admission.seen(keys)


def _admitted(slot: TierSlot, items: Items) -> Items:
    """The items ``slot``'s admission policy lets the chain write to it, counted."""
    if not items:
        return items
    if slot.admission.admits_everything:
        admitted = items
    else:
        answers = slot.admission.admit([key for key, _ in items])
        admitted = [item for item, admit in zip(items, answers) if admit]
    if admitted:
        slot.metrics.admission_admitted.labels(slot.label).inc(len(admitted))
    if len(admitted) < len(items):
        slot.metrics.admission_declined.labels(slot.label).inc(len(items) - len(admitted))
    return admitted


def _catch_up(slot: TierSlot, keys: list[str], fetched: Sequence[Fetched], index: int, before: list[bool]) -> None:
    """Write to ``slot`` (index ``index``) the loaded values from faster tiers that its
    policy admits, where it lacks them: declined when stored, or admitted then but never
    written (a write dropped from a full queue, a put that failed). Only keys this load
    admitted (not admitted ``before`` it) count as admitted."""
    candidates = [(key, hit.value, was) for key, hit, was in zip(keys, fetched, before) if hit.tier < index]
    if not candidates:
        return
    answers = slot.admission.admit([key for key, _, _ in candidates])
    newly = sum(admit and not was for (_, _, was), admit in zip(candidates, answers))
    if newly:
        slot.metrics.admission_admitted.labels(slot.label).inc(newly)
    _write_missing(slot, [(key, value) for (key, value, _), admit in zip(candidates, answers) if admit])


def put_missing(slot: TierSlot, items: Items) -> None:
    """Write to ``slot``'s tier the items whose keys it does not hold (all of them if it
    cannot tell): from the caller's thread, or an async tier's queue thread."""
    answers = slot.stored([key for key, _ in items])
    missing = items if answers is None else [item for item, has in zip(items, answers) if not has]
    if missing:
        slot.put(missing)


def _write(slot: TierSlot, items: Items) -> None:
    if slot.queue is not None:
        slot.queue.submit(items)
    else:
        slot.put(items)
        slot.settle()
