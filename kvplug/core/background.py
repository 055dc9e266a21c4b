"""A bounded queue drained by one worker thread: the engine's store queue and each
async tier's writer. Full queues block (up to a timeout) or drop; drops are counted."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, Literal, TypeVar

T = TypeVar("T")
logger = logging.getLogger("kvplug.background")
_STOP = object()


class BackgroundWorker(Generic[T]):
    """Runs ``handler(item)`` for each submitted item on a daemon thread, in order.

    ``submit`` never waits forever: with ``on_full="block"`` it waits up to
    ``block_timeout_s`` and then drops. ``close`` drains (``drain=True``) or
    discards what is queued, and joins the thread.
    """

    def __init__(
        self,
        name: str,
        handler: Callable[[T], None],
        *,
        max_items: int,
        on_full: Literal["block", "drop"] = "block",
        block_timeout_s: float = 30.0,
        on_drop: Callable[[T], None] | None = None,
    ) -> None:
        self.name = name
        self._handler = handler
        self._on_full = on_full
        self._block_timeout_s = block_timeout_s
        self._on_drop = on_drop
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_items)
        self._lock = threading.Lock()
        self._closed = False
        self.submitted = 0
        self.dropped = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T) -> bool:
        """Queue an item; ``False`` if it was dropped (queue full or closed)."""
        if self._closed:
            self._drop(item)
            return False
        try:
            if self._on_full == "block":
                self._queue.put(item, timeout=self._block_timeout_s)
            else:
                self._queue.put_nowait(item)
        except queue.Full:
            self._drop(item)
            return False
        with self._lock:
            self.submitted += 1
        return True

    def pending(self) -> int:
        return self._queue.unfinished_tasks

    def flush(self) -> None:
        """Wait until every queued item has been handled."""
        self._queue.join()

    def close(self, *, drain: bool = True) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not drain:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                self._drop(item)  # type: ignore[arg-type]
                self._queue.task_done()
        self._queue.put(_STOP)
        self._thread.join()

    def _drop(self, item: T) -> None:
        with self._lock:
            self.dropped += 1
        if self._on_drop is not None:
            self._on_drop(item)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                try:
                    self._handler(item)  # type: ignore[arg-type]
                except Exception:
                    with self._lock:
                        self.failed += 1
                    logger.exception("%s: handler failed", self.name)
            finally:
                self._queue.task_done()
