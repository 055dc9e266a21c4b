"""A record tier's view of what its store holds: value sizes in eviction order, bounded.

A remote store has no cheap "bytes used" or "least recently used", and a server may
evict keys without telling its clients. The index keeps both in this process, filled
by listing the store on start (when the backend can list) and kept up to date by this
process's writes, hits and removals. It serves ``stats()`` and the tier's ``max_bytes``
budget: past it, records are deleted in the order of the tier's eviction policy
(:mod:`kvplug.core.policies.eviction`: least recently used first, or S3-FIFO). So that it neither
grows with every key ever stored nor reports records long gone, it is bounded three ways:

- **A size bound**: at most ``max_keys`` entries. Past it the policy's next victim
  leaves the index, and :meth:`RecordIndex.record` returns it. Without
  ``max_bytes`` the tier forgets it (its record stays in the store until the store's
  own policy removes it); with ``max_bytes`` the tier deletes it, as an eviction, since
  bytes the index no longer counts would escape the budget.
- **Misses**: a read or lookup that finds an indexed record gone drops it.
- **A round of checks** (for stores that evict on their own): for each record newly
  indexed, the tier asks the store about :data:`CHECKS_PER_NEW_KEY` indexed records,
  the next ones in a round over all entries, and drops those that are gone. A full
  round ends before the index has gained a quarter of its size in new records, so
  records a store evicted are found while they are at most about a quarter of the
  index. The round has its own order, so checking a record never changes which
  record ``max_bytes`` evicts first. A store that does not evict on its own but whose
  records other processes may delete (an object store's lifecycle rules) is checked at
  :data:`RARE_LOSS_CHECKS_PER_NEW_KEY` when the tier keeps ``max_bytes`` by this index:
  a full round then ends before the index has doubled, a request or so per write.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from kvplug.core.policies.eviction import EvictionName, make_eviction_policy
from kvplug.core.records.store import StoredRecord

#: Indexed records checked against the store per record newly indexed (see the module docstring).
CHECKS_PER_NEW_KEY = 4
#: Records checked per round even when nothing new was indexed (writes of known keys).
CHECKS_PER_ROUND = 16
#: The same two rates for a store whose records go only when another process deletes them.
RARE_LOSS_CHECKS_PER_NEW_KEY = 1
RARE_LOSS_CHECKS_PER_ROUND = 1

#: (value bytes, key text or ``None`` when only a listing saw it). A new tuple per
#: :meth:`RecordIndex.record`: its identity tells whether an entry seen before a store
#: call was recorded again since.
Entry = tuple[int, str | None]
#: (digest, key text or ``None``) of a record that left the index.
Victim = tuple[str, str | None]


class RecordIndex:
    """Thread-safe index of value sizes by record digest (at most ``max_keys``), with the key
    text when known, in the order of its eviction policy (``lru`` or ``s3fifo``)."""

    def __init__(self, max_keys: int, *, evicts_when_full: bool = False, eviction: EvictionName = "lru") -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys}")
        self.max_keys = max_keys
        #: True: the tier deletes what :meth:`record` pushes out (counted as evictions, not here).
        self.evicts_when_full = evicts_when_full
        self._entries: dict[str, Entry] = {}
        # Holds exactly the digests of _entries, with their sizes; guarded by _lock like them.
        self._policy = make_eviction_policy(eviction)
        # Digests in the order they are next checked; a forgotten digest's slot is skipped when reached.
        self._round: deque[str] = deque()
        self._lock = threading.Lock()
        self._bytes = 0
        self._new = 0
        self._scanning = False
        self._forgotten_during_scan: set[str] = set()
        #: Entries forgotten to stay within ``max_keys`` (their records stayed in the store).
        self.dropped_full = 0
        #: Entries dropped because a read, lookup or check found the record gone.
        self.found_gone = 0

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def items(self) -> int:
        with self._lock:
            return len(self._entries)

    def size_of(self, digest: str) -> int | None:
        """The indexed value size of ``digest``, without touching its use order."""
        with self._lock:
            entry = self._entries.get(digest)
            return None if entry is None else entry[0]

    def record(self, digest: str, size: int, key: str | None) -> list[Victim]:
        """``size`` value bytes are stored under ``digest`` (written, or read back): for the
        eviction policy a new record, or an access to one indexed (with ``lru``: now the most
        recently used).

        Returns the entries pushed out to stay within ``max_keys``, in eviction order."""
        pushed: list[Victim] = []
        with self._lock:
            old = self._entries.get(digest)
            if old is not None:
                self._bytes -= old[0]
                key = key or old[1]
            else:
                self._new += 1
                self._round.append(digest)
            self._entries[digest] = (size, key)
            self._bytes += size
            self._policy.inserted(digest, size)
            while len(self._entries) > self.max_keys:
                gone = self._next_victim()
                dropped, gone_key = self._entries.pop(gone)
                self._bytes -= dropped
                self._note_forgotten(gone)
                pushed.append((gone, gone_key))
                if not self.evicts_when_full:
                    self.dropped_full += 1
            if len(self._round) > 2 * len(self._entries) + 1024:
                # Records forgotten and indexed again faster than rounds reach their old slots.
                self._round = deque(self._entries)
        return pushed

    def snapshot(self, digests: Iterable[str]) -> list[Entry | None]:
        """The current entry of each digest, to pass to :meth:`forget_gone` after asking the store."""
        with self._lock:
            return [self._entries.get(digest) for digest in digests]

    def forget_gone(self, digest: str, seen: Entry | None) -> str | None:
        """The store no longer holds ``digest``: drop it unless recorded again since ``seen`` was taken.

        A write that lands between the store's answer and this call leaves its entry in place.
        Returns the key of the entry dropped, when the index knew it (``None`` otherwise)."""
        if seen is None:
            return None
        with self._lock:
            if self._entries.get(digest) is not seen:
                return None
            del self._entries[digest]
            self._policy.removed(digest)
            self._bytes -= seen[0]
            self._note_forgotten(digest)
            self.found_gone += 1
            return seen[1]

    def forget(self, digest: str) -> str | None | bool:
        """Drop ``digest``; its key (``None`` if unknown) when it was indexed, else ``False``."""
        with self._lock:
            self._note_forgotten(digest)
            entry = self._entries.pop(digest, None)
            if entry is None:
                return False
            self._policy.removed(digest)
            self._bytes -= entry[0]
            return entry[1]

    def evict_over(self, budget: int) -> list[Victim]:
        """Remove entries in eviction order until ``bytes_used <= budget``; the removed ones."""
        victims: list[Victim] = []
        with self._lock:
            while self._bytes > budget and self._entries:
                digest = self._next_victim()
                size, key = self._entries.pop(digest)
                self._bytes -= size
                self._note_forgotten(digest)
                victims.append((digest, key))
        return victims

    def due_checks(self, per_new_key: int = CHECKS_PER_NEW_KEY, per_round: int = CHECKS_PER_ROUND) -> dict[str, Entry]:
        """The next indexed records of the round to check against the store, with their entries."""
        with self._lock:
            count = min(len(self._entries), per_new_key * self._new + per_round)
            self._new = 0
            due: dict[str, Entry] = {}
            # Every entry has a slot in the round, so this ends: each turn drops a dead
            # slot or moves a live one to the back.
            while len(due) < count and self._round:
                digest = self._round.popleft()
                entry = self._entries.get(digest)
                if entry is None or digest in due:
                    continue
                self._round.append(digest)
                due[digest] = entry
            return due

    # --- the start-up listing -------------------------------------------------------

    def begin_scan(self) -> None:
        with self._lock:
            self._scanning = True
            self._forgotten_during_scan.clear()

    def finish_scan(self, records: Iterable[StoredRecord], header_size: int) -> None:
        """Merge a listing: records not indexed yet enter as the eviction policy's first
        victims (``cold``), oldest first; records removed while the listing ran are not brought back. A full index
        takes the newest records of the listing (the others count as ``dropped_full``)."""
        with self._lock:
            newest_first = sorted(records, key=lambda r: r.modified or 0.0, reverse=True)
            for found in newest_first:
                if len(self._entries) >= self.max_keys:
                    self.dropped_full += 1
                    continue
                if found.digest in self._entries or found.digest in self._forgotten_during_scan:
                    continue
                size = max(found.size - header_size, 0)
                self._entries[found.digest] = (size, None)
                self._policy.inserted(found.digest, size, cold=True)
                self._round.append(found.digest)
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
            self._policy.clear()
            self._round.clear()
            self._bytes = 0
            self._new = 0

    @property
    def eviction(self) -> str:
        """The name of the eviction policy."""
        return self._policy.name

    def _next_victim(self) -> str:
        popped = self._policy.pop_victim()
        assert popped is not None, "the policy holds every indexed digest"
        return popped[0]

    def _note_forgotten(self, digest: str) -> None:
        if self._scanning:
            self._forgotten_during_scan.add(digest)
