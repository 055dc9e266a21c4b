"""Removing records from a record tier (:class:`RecordRemovals`, a base of
:class:`~kvplug.core.records.tier.RecordTier`): by name, only while the store holds the
value a load found unusable (``remove_if_same``), and the corrupt records a read found,
only where the store still holds what was read."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import ClassVar, TypeVar

from kvplug.core.events import KVEvent
from kvplug.core.records.backend import RecordBackend
from kvplug.core.records.frame import RECORD_HEADER_SIZE, key_digest, parse_record_header
from kvplug.core.records.index import RecordIndex
from kvplug.core.records.maintenance import RecordMaintenance
from kvplug.core.remote.calls import RemoteCalls
from kvplug.core.remote.retry import Absent
from kvplug.core.tier import Buffer, TierContext
from kvplug.errors import ChunkError, CorruptChunkError, RecordUnreadableError, TierUnavailableError

T = TypeVar("T")
A = TypeVar("A")
#: Corrupt records left in the store that this process remembers as absent.
MAX_SUSPECTS = 4096


class RecordRemovals(RecordMaintenance):
    """The removal methods of :class:`~kvplug.core.records.tier.RecordTier`, which sets the
    attributes below (a :class:`RecordMaintenance` for its ``read_record``)."""

    name: ClassVar[str]
    context: TierContext
    _backend: RecordBackend
    _calls: RemoteCalls
    _index: RecordIndex
    _where: str
    _lock: threading.Lock
    #: Names of corrupt records left in the store (no delete_if_same, or it failed), oldest first.
    _suspects: dict[str, None]

    def _groups(
        self, operation: Callable[[Sequence[A]], Awaitable[Sequence[T]]], items: Sequence[A], size: int
    ) -> list[tuple[Sequence[A], Sequence[T] | BaseException]]:
        raise NotImplementedError

    def _report(self, event: KVEvent) -> None:
        raise NotImplementedError

    def remove(self, keys: Sequence[str]) -> None:
        self._remove_by(keys, self._backend.delete, forget_absent=True)

    def remove_if_same(self, items: Sequence[tuple[str, Buffer]]) -> None:
        """Remove each record only while its value is the one given: read it again (a good
        record another process stored since survives), then delete it only if the store
        still holds those bytes (:meth:`RecordBackend.delete_if_same`). Comparing what is
        stored now, not a record framed here, also removes a record whose header this
        process did not check in full (shm's ``trust_host``). The record read again must also
        be one this process reads as that key's (:func:`is_record_of`): one it cannot read, a
        keyed record read without the integrity key or a later kvplug's, is kept for the
        processes that can, whatever value it holds, as a read keeps it. A backend that cannot
        compare and delete in one step (Mooncake, a valkey user without scripts) removes
        by name the records that still held the value at that second read: a record stored
        since the load survives, one stored between the second read and the removal (one
        round trip) does not, a lost hit for the engines sharing it, never wrong KV. A record
        the second read gets no answer for alone (a dead cluster node's) stays; the others go."""
        seen: dict[str, tuple[str, Buffer]] = {}
        for key, value in items:
            name = key_digest(key).hex()
            try:
                data = self.read_record(name)
            except CorruptChunkError:  # found bad unread: another record than the one the load read
                continue
            except RecordUnreadableError:  # no answer for this record alone (its cluster node down): it stays
                continue
            if data is None or not is_record_of(data, key):  # not the record the load read
                continue
            if memoryview(data).cast("B")[RECORD_HEADER_SIZE:] == memoryview(value).cast("B"):
                seen[name] = (key, data)
        if not self._backend.deletes_if_same:
            return self.remove([key for key, _ in seen.values()])
        backend = self._backend

        async def delete_if_same(names: Sequence[str]) -> Sequence[bool | BaseException]:
            return await backend.delete_if_same(names, [seen[name][1] for name in names])

        self._remove_by([key for key, _ in seen.values()], delete_if_same, forget_absent=False)

    def _remove_by(
        self,
        keys: Sequence[str],
        delete: Callable[[Sequence[str]], Awaitable[Sequence[bool | BaseException]]],
        *,
        forget_absent: bool,
    ) -> None:
        """Remove ``keys`` with ``delete`` (per name: whether it removed one); ``forget_absent``:
        unindex a name it did not remove too (else the record it left is still indexed)."""
        self._check_open()
        if not keys:
            return
        if not self._calls.allow(len(keys)):
            raise TierUnavailableError(
                f"tier {self.name}: {self._where} is unavailable (circuit breaker open); nothing removed"
            )
        key_of = {key_digest(key).hex(): key for key in keys}
        removed, failed = [], 0
        for group, result in self._groups(delete, list(key_of), self._backend.call_sizes.query):
            if isinstance(result, BaseException) and not isinstance(result, Absent):
                failed += len(group)
                continue
            existed = [False] * len(group) if isinstance(result, BaseException) else result
            for name, was_there in zip(group, existed):
                if isinstance(was_there, BaseException):  # failed for this name alone: still indexed
                    failed += 1
                elif (was_there or forget_absent) and (self._index.forget(name) is not False or was_there):
                    removed.append(key_of[name])
        if removed:
            self._report(KVEvent("removed", tuple(removed), tier=self.name))
        if failed:
            raise TierUnavailableError(f"tier {self.name}: {failed} of {len(keys)} removals from {self._where} failed")

    def _drop_corrupt(self, corrupt: list[tuple[str, Buffer | None]]) -> None:
        """Remove corrupt records only where the store still holds what was read
        (:meth:`RecordBackend.delete_if_same`): another process may have stored a good one
        since. One the backend could not remove so is absent to this process (its lookups
        miss, so the engine stores it again over the bad one) until stored or read whole."""
        for name, _ in corrupt:
            self._index.forget(name)
        kept = [name for name, _ in corrupt]
        if self._backend.deletes_if_same and self._calls.allow(len(corrupt)):
            kept = []
            backend = self._backend

            async def delete_if_same(group: Sequence[tuple[str, Buffer | None]]) -> Sequence[bool | BaseException]:
                return await backend.delete_if_same([name for name, _ in group], [data for _, data in group])

            for group, result in self._groups(delete_if_same, corrupt, backend.call_sizes.query):
                if isinstance(result, Absent):  # gone already
                    continue
                answers = [result] * len(group) if isinstance(result, BaseException) else result
                kept += [name for (name, _), answer in zip(group, answers) if isinstance(answer, BaseException)]
        with self._lock:
            for name in kept:
                self._suspects[name] = None
            while len(self._suspects) > MAX_SUSPECTS:  # the oldest go: lookups of them then ask the store
                del self._suspects[next(iter(self._suspects))]


def is_record_of(data: Buffer, key: str) -> bool:
    """Whether ``data`` is a whole record that this process reads as ``key``'s: its header's
    magic, version (a keyed one only with this process's integrity key, none of a later
    kvplug), checksum, key and length. Not its value's checksum or MAC: a value ``trust_host``
    served unchecked, damaged in place, is still that record's."""
    try:
        header = parse_record_header(data, key)
    except ChunkError:
        return False
    return memoryview(data).nbytes == header.record_length
