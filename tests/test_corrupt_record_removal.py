"""How a record tier removes a corrupt record: only through the backend's ``delete_if_same``;
a backend without it (one written by a third party, a store that cannot compare and delete
at once) keeps the record, and the tier takes it for absent until it is stored again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvplug import Buffer, CallSizes, RecordBackend, RecordTier, RecordTierConfig, RecordToWrite, TierContext
from kvplug.core.records.frame import RECORD_HEADER_SIZE, key_digest
from kvplug.testing import key_for, value_for

KEY = key_for("bad")
NAME = key_digest(KEY).hex()
VALUE = value_for("bad", 3000)


class DictBackend(RecordBackend):
    """Records in a dict, with only the primitives a backend must have (no delete_if_same)."""

    call_sizes = CallSizes(query=64, read=8, write=8, write_bytes=1 << 20)
    where = "a dict"

    def __init__(self) -> None:
        self.store: dict[str, bytes] = {}
        self.deletes: list[str] = []

    async def sizes(self, names: Sequence[str]) -> list[int | None]:
        return [len(self.store[n]) if n in self.store else None for n in names]

    async def read(self, names: Sequence[str], sizes: Sequence[int | None]) -> list[Buffer | None]:
        return [self.store.get(n) for n in names]

    async def write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        self.store.update((r.name, r.joined()) for r in records)
        return [None] * len(records)

    async def delete(self, names: Sequence[str]) -> list[bool]:
        self.deletes.extend(names)
        return [self.store.pop(n, None) is not None for n in names]


class ComparingBackend(DictBackend):
    """A backend that compares and deletes at once (its dict is only touched on the tier's loop)."""

    async def delete_if_same(self, names: Sequence[str], seen: Sequence[Buffer | None]) -> list[bool]:
        removed = []
        for name, data in zip(names, seen):
            same = data is not None and self.store.get(name) == bytes(data)
            removed.append(same and self.store.pop(name) is not None)
        return removed


class DictTier(RecordTier):
    name = "dict"
    Config = RecordTierConfig
    backend: DictBackend = DictBackend()

    def open_backend(self, loop: asyncio.AbstractEventLoop) -> RecordBackend:
        return self.backend


def make_tier(backend: DictBackend) -> DictTier:
    DictTier.backend = backend  # what open_backend, called by the constructor, answers
    return DictTier(RecordTierConfig.model_validate({}), TierContext(logger=logging.getLogger("test.corrupt")))


def damage(backend: DictBackend) -> None:
    data = bytearray(backend.store[NAME])
    data[RECORD_HEADER_SIZE + 7] ^= 0x10
    backend.store[NAME] = bytes(data)


def test_a_backend_without_delete_if_same_keeps_a_corrupt_record_and_the_tier_takes_it_for_absent() -> None:
    backend = DictBackend()
    tier = make_tier(backend)
    try:
        assert not backend.deletes_if_same
        tier.put([(KEY, VALUE)])
        damage(backend)
        assert tier.get([KEY]) == [None]
        assert tier.stats().extra["corrupt"] == 1
        # Removed by name, a good record another process stored there meanwhile would go too.
        assert backend.deletes == [] and NAME in backend.store
        # Absent to this process, so an engine's store path writes it again over the bad one...
        assert tier.contains([KEY]) == [False]
        tier.put([(KEY, VALUE)])
        # ... after which it is a hit again.
        assert tier.contains([KEY]) == [True]
        assert [bytes(v) for v in tier.get([KEY]) if v is not None] == [VALUE]
    finally:
        tier.close()


def test_a_backend_with_delete_if_same_removes_the_corrupt_record_it_read_and_nothing_else() -> None:
    backend = ComparingBackend()
    tier = make_tier(backend)
    try:
        assert backend.deletes_if_same
        tier.put([(KEY, VALUE)])
        damage(backend)
        assert tier.get([KEY]) == [None]
        assert NAME not in backend.store and backend.deletes == []
        assert tier.contains([KEY]) == [False]
    finally:
        tier.close()


def test_the_default_delete_if_same_removes_nothing() -> None:
    backend = DictBackend()
    backend.store[NAME] = b"x" * 100
    assert asyncio.run(backend.delete_if_same([NAME], [b"x" * 100])) == [False]
    assert NAME in backend.store
