"""``kvplug store`` maintenance of a record tier (:class:`~kvplug.core.records.store.RecordStore`):
list, read and delete records by digest, through the tier's backend and its deadlines."""

from __future__ import annotations

from collections.abc import Awaitable, Iterator, Sequence
from typing import TypeVar

from kvplug.core.records.backend import RecordBackend
from kvplug.core.records.calls import one_each
from kvplug.core.records.index import RecordIndex
from kvplug.core.records.store import StoredRecord
from kvplug.core.remote.calls import RemoteCalls
from kvplug.core.remote.retry import Absent
from kvplug.core.tier import Buffer
from kvplug.errors import CorruptChunkError, RecordUnreadableError, TierUnavailableError

T = TypeVar("T")
#: Listing a large store legitimately takes longer than one batch.
LISTING_TIMEOUT_S = 300.0
#: Times a removal is asked again while the backend answers ``BlockingIOError`` (busy).
BUSY_TRIES = 60


class RecordMaintenance:
    """The :class:`~kvplug.core.records.store.RecordStore` methods of
    :class:`~kvplug.core.records.tier.RecordTier`, which sets the attributes below."""

    _backend: RecordBackend
    _calls: RemoteCalls
    _index: RecordIndex

    def _check_open(self) -> None:
        raise NotImplementedError

    @property
    def listed_time(self) -> str:
        """What :attr:`StoredRecord.modified` of :meth:`records` means (:attr:`RecordBackend.listed_time`)."""
        return self._backend.listed_time

    def records(self) -> Iterator[StoredRecord]:
        """Every record in the store (its listing)."""
        self._check_open()
        return iter(self._calls.run(self._backend.listing, timeout_s=LISTING_TIMEOUT_S))

    def read_record(self, digest: str) -> Buffer | None:
        """The stored bytes (record frame and value), unverified; ``None`` if gone.
        Read with :meth:`RecordBackend.peek`: inspecting a record is not a use of it.
        Raises ``CorruptChunkError`` for a record the backend found bad before reading it
        (a size its header or the tier's bound rules out), :class:`RecordUnreadableError`
        when the store failed on this record alone (no permission to read it)."""
        self._check_open()
        try:
            (data,) = self._calls.run(lambda: _one(digest, self._backend.peek([digest], [None]), "peek"))
        except Absent:
            return None
        if isinstance(data, CorruptChunkError):  # found bad before it was read (its size)
            raise data
        if isinstance(data, BaseException):  # the store failed on this record alone
            raise RecordUnreadableError(f"{self._calls.where}: reading {digest} failed: {data}") from data
        return data

    def delete_record(self, digest: str) -> bool:
        self._check_open()
        self._index.forget(digest)
        try:
            (existed,) = self._calls.run(lambda: _one(digest, self._backend.delete([digest]), "delete"))
        except Absent:
            return False
        if isinstance(existed, BaseException):  # the store failed on this record alone
            raise TierUnavailableError(f"{self._calls.where}: removing {digest} failed: {existed}") from existed
        return existed

    def delete_record_if_same(self, digest: str, seen: Buffer | None) -> bool | None:
        """Remove one record only if the store still holds ``seen`` (the bytes
        :meth:`read_record` returned; ``None``: it raised ``CorruptChunkError`` and would
        still); whether it was removed, ``None`` when the backend cannot remove only those
        bytes (:meth:`RecordBackend.delete_if_same`; a backend may find that out on the
        first try: a server that ignores conditional deletes), so nothing was."""
        self._check_open()
        if not self._backend.deletes_if_same:
            return None
        self._index.forget(digest)
        for _ in range(BUSY_TRIES):  # a store busy with another process's write: an operator's removal waits
            try:
                (removed,) = self._calls.run(
                    lambda: _one(digest, self._backend.delete_if_same([digest], [seen]), "delete_if_same")
                )
            except Absent:
                return False
            if not isinstance(removed, BlockingIOError):
                break
        if isinstance(removed, BaseException):
            if not self._backend.deletes_if_same:  # found out only now (a server that ignores conditions)
                return None
            raise TierUnavailableError(f"{self._calls.where}: removing {digest} failed: {removed}") from removed
        return removed


async def _one(digest: str, call: Awaitable[Sequence[T]], name: str) -> Sequence[T]:
    """The answer of a call for the record ``digest``: one entry (:func:`one_each`)."""
    return one_each([digest], await call, name)
