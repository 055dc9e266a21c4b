"""A bounded queue drained by one worker thread: the engine's store queue and each
async tier's writer. Full queues block (up to a timeout) or drop; drops are counted.

The queue is bounded in items and, when given ``size_of``, in bytes: the items are
chunk data, and a bound in batches alone let a queue of large batches hold gigabytes.
An item's bytes count until its handler returns (the handler still holds the data).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, Literal, TypeVar

T = TypeVar("T")
logger = logging.getLogger("kvplug.background")


class BackgroundWorker(Generic[T]):
    """Runs ``handler(item)`` for each submitted item on a daemon thread, in order.

    ``submit`` never waits forever: with ``on_full="block"`` it waits up to
    ``block_timeout_s`` and then drops. ``close`` drains (``drain=True``) or
    discards what is queued, and joins the thread. An item is either handled or
    dropped (``on_drop``), never both and never neither, whatever the interleaving
    of ``submit`` and ``close``: both decide under one lock.
    """

    def __init__(
        self,
        name: str,
        handler: Callable[[T], None],
        *,
        max_items: int,
        max_bytes: int | None = None,
        size_of: Callable[[T], int] | None = None,
        on_full: Literal["block", "drop"] = "block",
        block_timeout_s: float = 30.0,
        on_drop: Callable[[T], None] | None = None,
    ) -> None:
        if max_items < 1:
            raise ValueError(f"{name}: max_items must be at least 1, got {max_items}")
        if max_bytes is not None and (max_bytes < 1 or size_of is None):
            raise ValueError(f"{name}: max_bytes must be at least 1 and needs size_of, got {max_bytes}")
        self.name = name
        self._handler = handler
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._size_of = size_of
        self._on_full = on_full
        self._block_timeout_s = block_timeout_s
        self._on_drop = on_drop
        self._cond = threading.Condition(threading.Lock())
        self._items: deque[tuple[T, int]] = deque()
        self._bytes = 0  # queued and being handled
        self._unfinished = 0  # queued and being handled
        self._closed = False
        self.submitted = 0
        self.dropped = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T, *, wait: bool = True) -> bool:
        """Queue an item; ``False`` if it was dropped (queue full or closed). ``wait=False``:
        never wait for room, whatever ``on_full`` (a caller that must not stall)."""
        size = self._size_of(item) if self._size_of is not None else 0
        deadline = time.monotonic() + self._block_timeout_s
        with self._cond:
            while not self._closed and not self._has_room(size):
                left = deadline - time.monotonic()
                if self._on_full == "drop" or not wait or left <= 0:
                    break
                self._cond.wait(left)
            accepted = not self._closed and self._has_room(size)
            if accepted:
                self._items.append((item, size))
                self._bytes += size
                self._unfinished += 1
                self.submitted += 1
                self._cond.notify_all()
        if not accepted:
            self._drop(item)
        return accepted

    def _has_room(self, size: int) -> bool:
        if len(self._items) >= self._max_items:
            return False
        # One item larger than the bound still passes when nothing else is held, or it never would.
        return self._max_bytes is None or self._unfinished == 0 or self._bytes + size <= self._max_bytes

    def pending(self) -> int:
        """Items queued or being handled."""
        with self._cond:
            return self._unfinished

    def queued_bytes(self) -> int:
        """Bytes (per ``size_of``) of the items queued or being handled."""
        with self._cond:
            return self._bytes

    def flush(self) -> None:
        """Wait until every queued item has been handled."""
        with self._cond:
            while self._unfinished and self._thread.is_alive():
                self._cond.wait(0.5)

    def close(self, *, drain: bool = True) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            discarded: list[T] = []
            if not drain:
                while self._items:
                    item, size = self._items.popleft()
                    self._bytes -= size
                    self._unfinished -= 1
                    discarded.append(item)
            self._cond.notify_all()
        for item in discarded:
            self._drop(item)
        self._thread.join()

    def discard_queued(self) -> int:
        """Drop (``on_drop``) what is queued and not yet being handled, also while a
        draining ``close`` waits: that close then ends when the item in hand is handled,
        not after everything queued. Returns how many were dropped."""
        with self._cond:
            discarded = [item for item, _ in self._items]
            self._bytes -= sum(size for _, size in self._items)
            self._unfinished -= len(self._items)
            self._items.clear()
            self._cond.notify_all()
        for item in discarded:
            self._drop(item)
        return len(discarded)

    def _drop(self, item: T) -> None:
        with self._cond:
            self.dropped += 1
        if self._on_drop is not None:
            self._on_drop(item)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:  # closed and drained
                    return
                item, size = self._items.popleft()
                self._cond.notify_all()  # room for an item (not yet for its bytes)
            try:
                self._handler(item)
            except Exception:
                with self._cond:
                    self.failed += 1
                logger.exception("%s: handler failed", self.name)
            finally:
                # Not held while waiting for the next item: a store batch is frames of the
                # engine's frame pool, which it gets back only when the last reference goes.
                del item
                with self._cond:
                    self._bytes -= size
                    self._unfinished -= 1
                    self._cond.notify_all()
