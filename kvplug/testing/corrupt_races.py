"""Tiers that let another writer in at the worst moment of a corrupt record's removal, for a
record tier's tests that a good record stored meanwhile survives
(:meth:`kvplug.core.records.backend.RecordBackend.delete_if_same`), and a check that a
tier's :meth:`~kvplug.StorageTier.remove_if_same` (a load's removal of a value it found
unusable) keeps what another writer stored since the read."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kvplug.core.records.tier import RecordTier
from kvplug.core.tier import Buffer, StorageTier
from kvplug.testing.storage_contract import key_for, value_for

T = TypeVar("T", bound=RecordTier)


def storing_before_corrupt_removal(tier_class: type[T], store_again: Callable[[], None]) -> type[T]:
    """``tier_class`` whose tier, between its read of a corrupt record and the record's removal,
    runs ``store_again`` once (another process or client storing a good record under that name).
    The removal by name of earlier versions is hooked too, so a test of it fails on them."""
    stored: list[bool] = []

    def once() -> None:
        if not stored:
            store_again()
            stored.append(True)

    class StoredAgainBeforeRemoval(tier_class):  # type: ignore[valid-type,misc]
        def _drop_corrupt(self, corrupt: list[tuple[str, Buffer | None]]) -> None:
            once()
            super()._drop_corrupt(corrupt)

        def _delete_quietly(self, names: list[str], *, forget: bool = True) -> None:
            once()
            super()._delete_quietly(names, forget=forget)

    return StoredAgainBeforeRemoval


def storing_after_gc_read(tier_class: type[T], store_again: Callable[[], None]) -> type[T]:
    """``tier_class`` as ``kvplug store gc`` opens it, whose every record read is followed by
    ``store_again`` (an engine storing the record again right after gc read the bad one)."""

    class StoredAgainAfterRead(tier_class):  # type: ignore[valid-type,misc]
        def read_record(self, digest: str) -> Buffer | None:
            data: Buffer | None = super().read_record(digest)
            store_again()
            return data

    return StoredAgainAfterRead


def check_remove_if_same_keeps_a_newer_value(tier: StorageTier, other: StorageTier) -> None:
    """``tier.remove_if_same`` of a value it read keeps the value ``other`` (another writer
    of the same store, or ``tier`` itself) stored under that key since the read, and
    removes the value read when nobody replaced it."""
    key = key_for("found unusable")
    unusable, good = value_for("unusable", 3000), value_for("good", 3000)
    other.put([(key, unusable)])
    other.flush()
    (read,) = tier.get([key])
    assert read is not None and bytes(read) == unusable
    other.put([(key, good)])  # between the load's read and its removal
    other.flush()
    tier.remove_if_same([(key, bytes(read))])
    assert [bytes(v) for v in tier.get([key]) if v is not None] == [good], "the value stored since was removed"
    (read,) = tier.get([key])
    assert read is not None
    tier.remove_if_same([(key, bytes(read))])
    assert tier.get([key]) == [None] and other.get([key]) == [None]
