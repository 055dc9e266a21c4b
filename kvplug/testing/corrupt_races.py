"""Tiers that let another writer in at the worst moment of a corrupt record's removal, for a
record tier's tests that a good record stored meanwhile survives
(:meth:`kvplug.core.records.backend.RecordBackend.delete_if_same`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kvplug.core.records.tier import RecordTier
from kvplug.core.tier import Buffer

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
