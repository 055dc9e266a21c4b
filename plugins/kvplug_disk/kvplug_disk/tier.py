"""Tier ``disk``: one crash-safe record file per key in a folder, within a byte budget
kept in the order of its ``eviction`` policy (``lru`` or ``s3fifo``).

A :class:`kvplug.RecordTier`: the base frames and verifies every record (a bad file is
a miss, counted as ``extra["corrupt"]``, and removed), counts, reports events and
serves ``kvplug store``; :class:`~kvplug_disk.backend.DiskBackend` keeps the files.

- Writes are atomic per key (temp file, fdatasync, rename, folder fsync; see
  :mod:`kvplug_disk.files`). ``put`` writes before it returns; by default the tier
  chain calls it from the write queue it keeps for the tier (``queue.mode: async``,
  see :mod:`kvplug_disk.config`), which serves values still queued from memory. The
  folders renamed into are fsynced as a group: on ``settle`` (which the chain calls
  when the tier's queue runs empty), at least every ``FOLDER_SYNC_INTERVAL_S``, and on
  ``flush``/``close``. A rename not yet synced can only be lost by a power failure, and then
  the key is simply absent: the file's data was synced before the rename, so a name
  never points at torn bytes.
- The folder is listed at start, before the tier serves, so a new process finds
  what the last one stored.
- Several processes may share the folder. ``contains`` and ``get`` ask the file
  system, so they see files another process wrote, and a file another process
  evicted is a miss, never an error. ``max_bytes`` is one budget for the folder as a
  whole, kept by the backend in the folder's ledger (:mod:`kvplug_disk.ledger`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from kvplug import Buffer, Medium, RecordBackend, RecordTier, TierContext, key_digest
from kvplug.errors import TierClosedError
from kvplug_disk.backend import DiskBackend
from kvplug_disk.config import DiskTierConfig
from kvplug_disk.location import disk_location_config
from kvplug_disk.preflight import check_folder
from kvplug_disk.problems import ProblemLog


class DiskTier(RecordTier):
    """Byte buffers as verified record files in a folder shared by any number of processes."""

    name = "disk"
    medium: ClassVar[Medium] = "disk"
    #: A lookup is a ``stat`` per key in a local folder: microseconds, no waiting on others.
    inline_lookups: ClassVar[bool] = True
    Config: ClassVar[type[DiskTierConfig]] = DiskTierConfig
    #: The store under the tier; tier ``shm`` maps its records instead of reading them.
    backend_class: ClassVar[type[DiskBackend]] = DiskBackend

    @classmethod
    def location_config(cls, location: str, options: Mapping[str, Any]) -> DiskTierConfig | None:
        """A folder path or ``file://`` URL that a disk tier wrote (see :mod:`kvplug_disk.location`)."""
        return disk_location_config(location, options)

    @classmethod
    def preflight(cls, config: DiskTierConfig) -> None:  # type: ignore[override]
        """The folder can be created and written (:func:`kvplug_disk.preflight.check_folder`)."""
        check_folder(config.path)

    def __init__(self, config: DiskTierConfig, context: TierContext) -> None:
        # Opened before the base, so that a folder that cannot be made raises its own
        # OSError (which names the path) rather than the base's wrapped TierError.
        self._disk = self.backend_class(
            config,
            ProblemLog(context.logger, _error_counter(context, self.name)),
            context.tenancy,
            read_only=context.read_only,
            record_bound=lambda: context.max_record_bytes,
        )
        try:
            super().__init__(config, context)
        except BaseException:
            self._disk.shut()
            raise
        self.config: DiskTierConfig = config
        self.flush()  # the start-up listing is indexed before the tier serves

    def open_backend(self, loop: asyncio.AbstractEventLoop) -> RecordBackend:
        return self._disk

    # The backend sees record names, not keys: it learns their tenants (cache_salts) here.

    def contains(self, keys: Sequence[str]) -> list[bool]:
        self._disk.tenant_names.note(keys)
        return super().contains(keys)

    def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        self._disk.tenant_names.note(keys)
        return super().get(keys)

    def put(self, items: Sequence[tuple[str, Buffer]]) -> None:
        self._disk.tenant_names.note(key for key, _ in items)
        super().put(items)

    def pin(self, keys: Sequence[str]) -> list[tuple[str, int]]:
        self._check_open()
        self._disk.tenant_names.note(keys)
        return list(self._disk.pin([key_digest(key).hex() for key in keys]))

    def unpin(self, keys: Sequence[str]) -> list[int | None]:
        self._check_open()
        sizes = self._disk.unpin([key_digest(key).hex() for key in keys])
        self._take_evicted()  # records of a tenant the unpinned ones put over its quota
        return sizes

    def settle(self) -> None:
        """The chain has nothing more to write here for now: sync the folders renamed into."""
        with contextlib.suppress(TierClosedError):
            self.flush()


def _error_counter(context: TierContext, tier: str) -> Callable[[str], None] | None:
    """Errors of writes reach the engine's ``kvplug_tier_errors`` counter
    (the tier chain counts only calls that raise, and failed writes are counted, not raised)."""
    metrics = getattr(context, "metrics", None)
    if metrics is None:
        return None
    label = f"{context.tier_index}:{tier}"
    return lambda op: metrics.tier_errors.labels(label, op).inc()
