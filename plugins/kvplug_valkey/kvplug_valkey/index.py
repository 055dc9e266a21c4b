"""This process's view of what it stored in the server: value sizes in use order.

The server's ``maxmemory`` is the shared cache's budget. The index serves ``stats()``
(bytes and items this process wrote or read) and the optional per-process ``max_bytes``:
past it, the least recently used keys this process knows are deleted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class KeyIndex:
    """Thread-safe LRU of value sizes by key digest, with the key text when known."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, tuple[int, str | None]] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def items(self) -> int:
        with self._lock:
            return len(self._entries)

    def record(self, digest: str, size: int, key: str | None) -> None:
        """``size`` value bytes are stored under ``digest``: now the most recently used."""
        with self._lock:
            old = self._entries.pop(digest, None)
            if old is not None:
                self._bytes -= old[0]
                key = key or old[1]
            self._entries[digest] = (size, key)
            self._bytes += size

    def forget(self, digest: str) -> str | None | bool:
        """Drop ``digest``; its key (``None`` if unknown) when it was indexed, else ``False``."""
        with self._lock:
            entry = self._entries.pop(digest, None)
            if entry is None:
                return False
            self._bytes -= entry[0]
            return entry[1]

    def evict_over(self, budget: int) -> list[tuple[str, str | None]]:
        """Remove least recently used entries until ``bytes_used <= budget``; the removed (digest, key)s."""
        victims = []
        with self._lock:
            while self._bytes > budget and self._entries:
                digest, (size, key) = self._entries.popitem(last=False)
                self._bytes -= size
                victims.append((digest, key))
        return victims

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
