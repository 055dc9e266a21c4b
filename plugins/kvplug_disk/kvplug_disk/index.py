"""The in-memory index of tier ``disk``: which records exist, their sizes, LRU order.

Rebuilt from the folder at start (order by mtime: writes and hits set it), kept up
to date by this process's own writes and reads, and corrected whenever the file
system disagrees (a file another process wrote or evicted). It is not thread-safe:
the tier holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(slots=True)
class IndexEntry:
    """One record file. ``key`` is known once this process wrote or read it."""

    value_size: int
    file_size: int
    key: str | None = None


class LRUIndex:
    """Record digests, least recently used first, with exact byte totals."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, IndexEntry] = OrderedDict()
        self.value_bytes = 0
        self.file_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: str) -> bool:
        return digest in self._entries

    def get(self, digest: str) -> IndexEntry | None:
        return self._entries.get(digest)

    def add(self, digest: str, entry: IndexEntry) -> None:
        """Insert or replace as the most recently used."""
        self.pop(digest)
        self._entries[digest] = entry
        self.value_bytes += entry.value_size
        self.file_bytes += entry.file_size

    def add_new(self, digest: str, entry: IndexEntry) -> None:
        """Append an entry known to be absent (start-up: skips ``add``'s lookup)."""
        self._entries[digest] = entry
        self.value_bytes += entry.value_size
        self.file_bytes += entry.file_size

    def touch(self, digest: str, key: str | None = None) -> None:
        entry = self._entries.get(digest)
        if entry is not None:
            self._entries.move_to_end(digest)
            if key is not None:
                entry.key = key

    def pop(self, digest: str) -> IndexEntry | None:
        entry = self._entries.pop(digest, None)
        if entry is not None:
            self.value_bytes -= entry.value_size
            self.file_bytes -= entry.file_size
        return entry

    def pop_oldest(self, file_bytes: int) -> list[tuple[str, IndexEntry]]:
        """Remove least recently used entries until their files add up to ``file_bytes``."""
        victims = []
        freed = 0
        while self._entries and freed < file_bytes:
            digest, entry = self._entries.popitem(last=False)
            self.value_bytes -= entry.value_size
            self.file_bytes -= entry.file_size
            freed += entry.file_size
            victims.append((digest, entry))
        return victims

    def items(self) -> Iterator[tuple[str, IndexEntry]]:
        return iter(list(self._entries.items()))
