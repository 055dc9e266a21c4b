"""This process's view of what the tier stores: sizes and access order by digest.

A remote store has no cheap "bytes used" or "least recently used": the index
keeps both in process, filled by listing the prefix on start and kept up to date
by this process's puts, hits and removals. Other writers' objects enter it when
this process reads them. With ``max_bytes`` the tier evicts from the index's
least recently used end and deletes those objects.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from kvplug_s3.backend import StoredObject


@dataclass
class _Entry:
    size: int
    key: str | None  # None for objects only seen by listing: names are digests


class SizeIndex:
    """Thread-safe LRU of value sizes by key digest."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._bytes = 0
        self._scanning = False
        self._forgotten_during_scan: set[str] = set()

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def items(self) -> int:
        with self._lock:
            return len(self._entries)

    def record(self, digest: str, size: int, key: str | None) -> None:
        """A value of ``size`` bytes is stored under ``digest``, most recently used."""
        with self._lock:
            old = self._entries.pop(digest, None)
            if old is not None:
                self._bytes -= old.size
                key = key or old.key
            self._entries[digest] = _Entry(size, key)
            self._bytes += size

    def forget(self, digest: str) -> str | None | bool:
        """Drop ``digest``; its key (or ``None`` if unknown) when it was indexed, else ``False``."""
        with self._lock:
            if self._scanning:
                self._forgotten_during_scan.add(digest)
            entry = self._entries.pop(digest, None)
            if entry is None:
                return False
            self._bytes -= entry.size
            return entry.key

    def evict_over(self, budget: int) -> list[tuple[str, str | None]]:
        """Remove least recently used entries until ``bytes_used <= budget``."""
        victims = []
        with self._lock:
            while self._bytes > budget and self._entries:
                digest, entry = self._entries.popitem(last=False)
                self._bytes -= entry.size
                if self._scanning:
                    self._forgotten_during_scan.add(digest)
                victims.append((digest, entry.key))
        return victims

    def begin_scan(self) -> None:
        with self._lock:
            self._scanning = True
            self._forgotten_during_scan.clear()

    def finish_scan(self, objects: list[StoredObject], header_size: int) -> None:
        """Merge a listing: unknown objects enter as least recently used, oldest
        first. Objects removed while the listing ran are not brought back."""
        with self._lock:
            for item in sorted(objects, key=lambda o: o.modified, reverse=True):
                if item.digest in self._entries or item.digest in self._forgotten_during_scan:
                    continue
                size = max(item.size - header_size, 0)
                self._entries[item.digest] = _Entry(size, None)
                self._entries.move_to_end(item.digest, last=False)
                self._bytes += size
            self._scanning = False
            self._forgotten_during_scan.clear()

    def abandon_scan(self) -> None:
        with self._lock:
            self._scanning = False
            self._forgotten_during_scan.clear()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
