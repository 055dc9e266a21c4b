"""The eviction order of tier ``disk``'s folder budget: record files, sizes, LRU order.

The disk backend keeps the ``max_bytes`` of the whole folder itself (see
:mod:`kvplug_disk.ledger`), so it needs the order of the files it may evict, which
the record tier's own index (keys, sizes for ``stats()``) does not give. Rebuilt from
the folder at start (order by mtime: writes and hits set it), kept up to date by this
process's writes and reads, corrected whenever the file system disagrees (a file
another process wrote or evicted), and rebuilt when it has nothing left to evict while
the folder is over budget. Not thread-safe: the backend holds its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(slots=True)
class IndexEntry:
    """One record file."""

    value_size: int
    file_size: int


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

    def touch(self, digest: str) -> None:
        if digest in self._entries:
            self._entries.move_to_end(digest)

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
