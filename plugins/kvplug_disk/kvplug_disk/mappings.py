"""The record files a process of tier ``shm`` keeps mapped between its reads of them.

Mapping a file of 4 KiB tmpfs pages costs a page-table entry per page, set up by page
faults as the mapping is first read: about 0.5 µs a page, which holds a read of a newly
mapped record to a third of memcpy's speed. A mapping kept after the read costs none of
that again: the next read of the record from this process touches pages already in its
page tables, at memory speed. So the tier keeps the mappings it made (the pages are the
folder's, shared with every process; what a kept mapping adds is its page-table entries,
8 bytes per 4 KiB page) and reuses one when the record's name still leads to the same file.

A kept mapping is of one file (device, inode, size). The name is opened on every read,
so a record renamed over by a new write (a new inode) is mapped anew, and a name that is
gone is a miss. The one cost of keeping: an unlinked file's pages are freed when its last
mapping goes, so a record evicted by another process stays in memory while this process
keeps it mapped. A sweeper thread, running while any mapping is kept, lets go every
``SWEEP_INTERVAL_S`` seconds of the mappings whose names no longer lead to their files
(an idle process too: it would otherwise hold up to ``keep_mapped_bytes`` of records
the folder no longer counts); an eviction or removal by this process lets go at once.

Whether a mapping's checksum was verified is kept with it: a record file is never
written in place by kvplug (docs/security.md), so a file verified once stays verified
while it is mapped.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger("kvplug.tier.shm")

#: How often kept mappings are checked against the folder: about the longest a kept mapping
#: of a record another process evicted outlives the eviction.
SWEEP_INTERVAL_S = 1.0
#: The kernel's limit on one process's mappings; kept mappings take at most a quarter of it.
MAX_MAP_COUNT_SETTING = "/proc/sys/vm/max_map_count"
_DEFAULT_MAX_MAP_COUNT = 65530

#: Which file a mapping is of: device, inode and size (a record renamed over has a new inode).
FileIdentity = tuple[int, int, int]


def identity_of(info: os.stat_result) -> FileIdentity:
    return (info.st_dev, info.st_ino, info.st_size)


@dataclass
class _Kept:
    identity: FileIdentity
    mapping: mmap.mmap
    verified: bool = False


class MappedRecords:
    """Mappings of record files kept for reuse, least recently read first to go,
    within ``max_bytes`` and ``max_count`` (see the module docstring). Thread-safe."""

    def __init__(
        self, max_bytes: int, stat: Callable[[str], os.stat_result | None], max_count: int | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self.max_count = max_map_count() // 4 if max_count is None else max_count
        self._stat = stat
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.counts = {"mapping_reuses": 0, "mappings_swept": 0}

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_count > 0

    def reuse(self, digest: str, info: os.stat_result) -> mmap.mmap | None:
        """The kept mapping of ``digest``'s file, if it is the file ``info`` describes;
        a mapping of another file under that name is let go."""
        with self._lock:
            kept = self._kept.get(digest)
            if kept is None:
                return None
            if kept.identity != identity_of(info):
                self._drop(digest)
                return None
            self._kept.move_to_end(digest)
            self.counts["mapping_reuses"] += 1
            return kept.mapping

    def keep(self, digest: str, info: os.stat_result, mapping: mmap.mmap) -> None:
        """Keep ``mapping`` of ``digest``'s file, letting the least recently read go over the limits."""
        size = len(mapping)
        if not self.enabled or size > self.max_bytes:
            return
        with self._lock:
            if self._closed.is_set():
                return
            self._drop(digest)
            self._kept[digest] = _Kept(identity_of(info), mapping)
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._kept) > self.max_count:
                self._drop(next(iter(self._kept)))
            if self._sweeper is None:
                self._sweeper = threading.Thread(target=self._sweep_until_closed, name="kvplug-shm-sweep", daemon=True)
                self._sweeper.start()

    def verified(self, digest: str, data: object) -> bool:
        """Whether ``data`` is a view of the kept mapping of ``digest`` whose checksum was verified."""
        with self._lock:
            kept = self._kept.get(digest)
            return kept is not None and kept.verified and _mapping_under(data) is kept.mapping

    def mark_verified(self, digest: str, data: object) -> None:
        """``data``'s checksum was verified: if it is a view of the kept mapping of ``digest``, so is that."""
        with self._lock:
            kept = self._kept.get(digest)
            if kept is not None and _mapping_under(data) is kept.mapping:
                kept.verified = True

    def forget(self, digests: Iterable[str]) -> None:
        """Let go of the mappings of records this process evicted or removed."""
        with self._lock:
            for digest in digests:
                self._drop(digest)

    def sweep(self) -> None:
        """Let go of the mappings whose names no longer lead to their files (evicted, removed
        or written again by another process); a name whose stat fails is let go too."""
        with self._lock:
            kept = {digest: entry.identity for digest, entry in self._kept.items()}
        gone = []
        for digest, identity in kept.items():  # without the lock: reads go on meanwhile
            try:
                found = self._stat(digest)
            except OSError:
                found = None
            if found is None or identity_of(found) != identity:
                gone.append(digest)
        with self._lock:
            for digest in gone:
                entry = self._kept.get(digest)
                if entry is not None and kept[digest] == entry.identity:  # not mapped anew meanwhile
                    self._drop(digest)
                    self.counts["mappings_swept"] += 1

    def _sweep_until_closed(self) -> None:
        while not self._closed.wait(SWEEP_INTERVAL_S):
            try:
                self.sweep()
            except Exception:  # a sweeper that died would keep evicted records in memory for good
                logger.exception("tier shm: sweeping kept mappings failed; trying again in %s s", SWEEP_INTERVAL_S)

    def close(self) -> None:
        """Stop the sweeper and let go of every kept mapping (before the folder is closed)."""
        with self._lock:
            self._closed.set()
            sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            sweeper.join()
        self.clear()

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._bytes = 0

    def describe(self) -> dict[str, int]:
        with self._lock:
            return {**self.counts, "mapped_records": len(self._kept), "mapped_bytes": self._bytes}

    def _drop(self, digest: str) -> None:
        # The mapping itself is unmapped when the last view of it is released (a caller may hold one).
        kept = self._kept.pop(digest, None)
        if kept is not None:
            self._bytes -= len(kept.mapping)


def _mapping_under(data: object) -> object:
    return data.obj if isinstance(data, memoryview) else data


def max_map_count(setting: str = MAX_MAP_COUNT_SETTING) -> int:
    """The host's limit on the mappings of one process (``vm.max_map_count``)."""
    try:
        with open(setting, encoding="ascii") as found:
            return int(found.read().strip())
    except (OSError, ValueError):
        return _DEFAULT_MAX_MAP_COUNT
