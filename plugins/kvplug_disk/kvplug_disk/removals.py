"""The removals of tier ``disk``'s backend (:class:`~kvplug_disk.backend.DiskBackend`): records
removed by name, and corrupt records removed only while the folder still holds them as read."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvplug import Buffer
from kvplug_disk.files import RecordFolder
from kvplug_disk.index import EvictionIndex
from kvplug_disk.ledger import FolderLockTimeoutError, Usage, UsageLedger
from kvplug_disk.pin_marks import PinMarks

#: Longest a corrupt record's removal (from a read) waits for the folder's lock, which a
#: paused process may hold for ever.
REMOVAL_LOCK_WAIT_S = 1.0


class DiskRemovals:
    """The removal methods of :class:`~kvplug_disk.backend.DiskBackend`, which sets the attributes below."""

    read_only: bool
    where: str
    _ledger: UsageLedger
    _lock_wait_s: float
    _lock: threading.Lock
    _order: EvictionIndex
    _folder: RecordFolder
    _marks: PinMarks
    _record_bound: Callable[[], int | None]

    if TYPE_CHECKING:  # (the backend's and FolderBudget's: stubs here would come first in its bases)

        def _skipped(self, digest: str) -> bool: ...

        def _entry_failed(self, op: str, digest: str, exc: OSError, *, locked: bool = False) -> bool: ...

        def _unlink_record(self, usage: Usage, digest: str, op: str) -> bool: ...

    async def delete(self, names: Sequence[str]) -> Sequence[bool | BaseException]:
        if self.read_only:
            return [ReadOnlyStoreError(self.where) for _ in names]
        return self._delete(names)

    def _delete(self, names: Sequence[str]) -> Sequence[bool | BaseException]:
        try:
            with self._ledger.locked(timeout_s=self._lock_wait_s, then="nothing was removed") as usage, self._lock:
                existed = []
                for digest in names:
                    self._order.pop(digest)
                    existed.append(self._unlink_record(usage, digest, "remove"))
                return existed
        except FolderLockTimeoutError as exc:  # nothing removed: the removal fails, naming why
            return [exc for _ in names]

    async def delete_if_same(
        self, names: Sequence[str], seen: Sequence[Buffer | None]
    ) -> Sequence[bool | BaseException]:
        """Compare and unlink under the folder's lock, which every process's publish of a
        record takes too: a good record renamed over a bad one since it was read stays."""
        if self.read_only:
            return [ReadOnlyStoreError(self.where) for _ in names]
        try:
            with (
                self._ledger.locked(
                    timeout_s=REMOVAL_LOCK_WAIT_S, then="the corrupt record stays (absent to this process)"
                ) as usage,
                self._lock,
            ):
                return self._delete_if_same(usage, names, seen)
        except FolderLockTimeoutError as exc:  # no answer: the tier keeps the name absent, a later read tries again
            return [exc for _ in names]

    def _delete_if_same(
        self, usage: Usage, names: Sequence[str], seen: Sequence[Buffer | None]
    ) -> list[bool | BaseException]:
        """Unlink each record the folder still holds as it was read (both locks held)."""
        removed: list[bool | BaseException] = []
        for digest, data in zip(names, seen):
            try:
                same = not self._skipped(digest) and self._folder.holds(digest, data, self._record_bound())
            except OSError as exc:
                self._entry_failed("remove", digest, exc, locked=True)
                removed.append(exc)
                continue
            if same:
                self._order.pop(digest)
            removed.append(same and self._unlink_record(usage, digest, "remove"))
        return removed


class ReadOnlyStoreError(OSError):
    """A write or removal in a store opened for inspection (``read_only``)."""

    def __init__(self, where: str) -> None:
        super().__init__(errno.EROFS, f"{where} is open for inspection only", where)
