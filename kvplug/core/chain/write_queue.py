"""The write-behind queue the tier chain keeps for each ``queue.mode: async`` tier.

What every async tier gets from it, whatever the tier:

- **Readable at once.** A value is pending from the moment it is queued until its tier
  has it; the chain answers ``get``/``contains`` for pending keys from here, so a store
  is readable before the tier has written it.
- **Coalesced.** A second write of a key still queued replaces it: the older value is
  never written. A write the queue refuses (full) replaces nothing: the key's older
  queued write is still written and still answers reads.
- **Cancelled.** :meth:`WriteQueue.cancel` (the chain's ``discard``) forgets queued
  writes of the keys and waits for one of them being written to finish, so the
  ``remove`` that follows cannot be overtaken by it.
- **Drained or dropped on close** (``queue.on_close``), and bounded in batches and bytes
  (``queue.max_items``, ``queue.max_bytes``), blocking or dropping when full
  (``queue.on_full``); every dropped batch is counted.

When the queue runs empty it calls ``settle`` (the tier's :meth:`~kvplug.StorageTier.settle`
hook), so a tier can group work over a busy queue's writes (the disk tier's folder fsyncs).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvplug.core.background import BackgroundWorker
from kvplug.core.queue_settings import QueueSettings
from kvplug.core.tier import Buffer

logger = logging.getLogger("kvplug.tiers")

#: A batch of values to write: (key, value) pairs.
Items = list[tuple[str, Buffer]]


@dataclass(eq=False)
class _Write:
    """One queued value; its identity tells whether a later write or a cancel superseded it."""

    key: str
    value: Buffer
    # Until the worker accepts this write, the older pending write of its key: if the
    # worker refuses this one, that one answers reads again and is still written.
    replaced: _Write | None = None
    accepted: bool = False


def _same(value: Buffer, other: Buffer) -> bool:
    return memoryview(value).cast("B") == memoryview(other).cast("B")


def _writes_bytes(writes: list[_Write]) -> int:
    return sum(memoryview(write.value).nbytes for write in writes)


class WriteQueue:
    """One tier's bounded write-behind queue; see the module docstring.

    ``write(items)`` writes a batch into the tier (on the queue's thread); ``settle()``
    runs when the queue has nothing more to write; ``on_drop()`` counts a dropped batch.
    """

    def __init__(
        self,
        name: str,
        settings: QueueSettings,
        write: Callable[[Items], None],
        *,
        settle: Callable[[], None] = lambda: None,
        on_drop: Callable[[], None] = lambda: None,
    ) -> None:
        self.settings = settings
        self._write = write
        self._settle = settle
        self._count_drop = on_drop
        self._cond = threading.Condition(threading.Lock())
        self._pending: dict[str, _Write] = {}
        self._writing: set[str] = set()  # keys of the batch being written
        self._worker: BackgroundWorker[list[_Write]] = BackgroundWorker(
            name,
            self._handle,
            max_items=settings.max_items,
            max_bytes=int(settings.max_bytes),
            size_of=_writes_bytes,
            on_full=settings.on_full,
            block_timeout_s=settings.block_timeout_s,
            on_drop=self._dropped,
        )

    @property
    def dropped(self) -> int:
        """Batches dropped (queue full, or closed with ``on_close: drop``)."""
        return self._worker.dropped

    def pending(self) -> int:
        """Batches queued or being written."""
        return self._worker.pending()

    def submit(self, items: Items) -> bool:
        """Queue a batch; ``False`` if it was dropped. Its values are readable at once."""
        writes = [_Write(key, value) for key, value in items]
        with self._cond:
            for write in writes:  # readable at once, before the worker has room for it
                write.replaced = self._pending.get(write.key)
                self._pending[write.key] = write
        accepted = self._worker.submit(writes)  # a dropped batch comes back through _dropped
        if accepted:
            with self._cond:
                self._accept(writes)
        return accepted

    def holds(self, keys: Sequence[str]) -> list[bool]:
        """Whether a write of each key is queued or being written (it may still land)."""
        with self._cond:
            return [key in self._pending for key in keys]

    def values(self, keys: Sequence[str]) -> list[Buffer | None]:
        """The pending value of each key (read-only), ``None`` where none is pending."""
        with self._cond:
            found = [self._pending.get(key) for key in keys]
        return [None if write is None else memoryview(write.value).toreadonly() for write in found]

    def cancel(self, keys: Sequence[str], *, only: Mapping[str, Buffer] | None = None) -> list[str]:
        """Forget queued writes of ``keys``; wait (up to ``block_timeout_s``) for a write of
        one of them in progress to end. Returns the keys whose queued write was forgotten.
        ``only``: forget a key's queued writes only while the newest is the value given (a
        value found unusable); a newer one (this process's own store) is still written."""
        wanted = set(keys)
        deadline = time.monotonic() + self.settings.block_timeout_s
        with self._cond:
            if only is not None:
                queued = [(key, self._pending.get(key)) for key in wanted]
                wanted = {key for key, write in queued if write is None or _same(write.value, only[key])}
            cancelled = [key for key in wanted if self._pending.pop(key, None) is not None]
            while self._writing & wanted:
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("%s: a write of a removed key is still in progress", self._worker.name)
                    break
                self._cond.wait(left)
        return cancelled

    def flush(self) -> None:
        """Wait until every batch accepted so far has been written (or failed)."""
        self._worker.flush()

    def close(self, *, drain: bool = True) -> None:
        """Stop the thread: write what is queued when ``drain`` and ``on_close: drain``, else drop it."""
        self._worker.close(drain=drain and self.settings.on_close == "drain")

    def discard_queued(self) -> int:
        """Drop the batches queued and not yet being written (counted), also during a
        draining close; returns how many."""
        return self._worker.discard_queued()

    def _handle(self, writes: list[_Write]) -> None:
        with self._cond:
            self._accept(writes)  # being handled: accepted, whether or not submit has seen it yet
            wanted = [write for write in writes if self._due(write)]
            self._writing = {write.key for write in wanted}
        try:
            if wanted:
                self._write([(write.key, write.value) for write in wanted])
        finally:
            with self._cond:
                for write in wanted:  # written (or failed): the tier answers for it now
                    self._unlink(write)
                self._writing = set()
                self._cond.notify_all()
        if self._worker.pending() <= 1:  # 1: this batch
            self._settle()

    def _dropped(self, writes: list[_Write]) -> None:
        with self._cond:
            for write in writes:  # the older write each replaced (if still queued) is pending again
                self._unlink(write)
        self._count_drop()

    # The pending writes of a key form a chain from ``_pending[key]``, newest first, through
    # ``replaced``; it ends at the newest accepted write. The methods below hold ``_cond``.

    def _accept(self, writes: list[_Write]) -> None:
        for write in writes:  # the older writes it replaced are superseded for good
            write.accepted = True
            write.replaced = None

    def _due(self, write: _Write) -> bool:
        """Whether the worker writes ``write``: neither cancelled nor replaced by an
        accepted write (a newer write not yet accepted may still be refused)."""
        newer = self._pending.get(write.key)
        while newer is not None and newer is not write:
            if newer.accepted:
                return False
            newer = newer.replaced
        return newer is write

    def _unlink(self, write: _Write) -> None:
        """Take ``write`` out of its key's chain (if it is still there)."""
        newer, node = None, self._pending.get(write.key)
        while node is not None and node is not write:
            newer, node = node, node.replaced
        if node is None:
            return
        if newer is not None:
            newer.replaced = write.replaced
        elif write.replaced is not None:
            self._pending[write.key] = write.replaced
        else:
            del self._pending[write.key]
