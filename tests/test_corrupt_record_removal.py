"""How a record tier removes a corrupt record: only through the backend's ``delete_if_same``;
a backend without it (one written by a third party, a store that cannot compare and delete
at once) keeps the record, and the tier takes it for absent until it is stored again."""

from __future__ import annotations

import asyncio
import logging

from core_helpers import ComparingDictBackend, DictRecordBackend

from kvplug import RecordBackend, RecordTier, RecordTierConfig, TierContext
from kvplug.core.records.frame import RECORD_HEADER_SIZE, key_digest
from kvplug.testing import key_for, value_for

KEY = key_for("bad")
NAME = key_digest(KEY).hex()
VALUE = value_for("bad", 3000)


class DictTier(RecordTier):
    name = "dict"
    Config = RecordTierConfig
    backend: DictRecordBackend = DictRecordBackend()

    def open_backend(self, loop: asyncio.AbstractEventLoop) -> RecordBackend:
        return self.backend


def make_tier(backend: DictRecordBackend) -> DictTier:
    DictTier.backend = backend  # what open_backend, called by the constructor, answers
    return DictTier(RecordTierConfig.model_validate({}), TierContext(logger=logging.getLogger("test.corrupt")))


def damage(backend: DictRecordBackend) -> None:
    data = bytearray(backend.store[NAME])
    data[RECORD_HEADER_SIZE + 7] ^= 0x10
    backend.store[NAME] = bytes(data)


def test_a_backend_without_delete_if_same_keeps_a_corrupt_record_and_the_tier_takes_it_for_absent() -> None:
    backend = DictRecordBackend()
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
    backend = ComparingDictBackend()
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
    backend = DictRecordBackend()
    backend.store[NAME] = b"x" * 100
    assert asyncio.run(backend.delete_if_same([NAME], [b"x" * 100])) == [False]
    assert NAME in backend.store
