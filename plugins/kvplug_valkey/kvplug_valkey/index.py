"""This process's view of what it stored in the server: value sizes in use order, bounded.

The server's ``maxmemory`` is the shared cache's budget, and the server evicts (and
expires) keys without telling any client. The index serves ``stats()`` (bytes and
items this process wrote or read) and the optional per-process ``max_bytes``: past it,
the least recently used keys this process knows are deleted. So that it neither grows
with every key ever stored nor reports keys long gone, it is bounded three ways:

- **A size bound**: at most ``max_keys`` entries. Past it the least recently used
  entry leaves the index, and :meth:`KeyIndex.record` returns it. Without
  ``max_bytes`` the tier forgets it (its value stays in the server until the
  server's own policy evicts it); with ``max_bytes`` the tier deletes it, as an
  eviction, since bytes the index no longer counts would escape the budget.
- **Misses**: a read or lookup that finds an indexed key gone drops it.
- **A round of checks**: for each key newly indexed, the tier asks the server
  (pipelined ``EXISTS``, which leaves the keys' LRU/LFU data as it was, after a put
  that fully succeeded) about :data:`CHECKS_PER_NEW_KEY` indexed keys,
  the next ones in a round over all entries, and drops those that are gone. A full
  round ends before the index has gained a quarter of its size in new keys, so keys
  evicted by a server that this process fills with chunks of one size (a model's
  chunks are) are found while they are at most about a quarter of the index: items and
  bytes are then at most about a third above what the server holds. With other
  writers filling the server, keys may stay indexed after they are gone until the
  round reaches them; the figures are an estimate and ``stats()`` says so.

The round has its own order (a queue of digests), so checking a key never changes
which key ``max_bytes`` evicts first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

#: Indexed keys checked against the server per key newly indexed (see the module docstring).
CHECKS_PER_NEW_KEY = 4
#: Keys checked per round of checks even when nothing new was indexed (writes of known keys).
CHECKS_PER_ROUND = 16

#: (value bytes, key text or ``None``). A new tuple per :meth:`KeyIndex.record`: its
#: identity tells whether an entry seen before a server call was recorded again since.
Entry = tuple[int, str | None]


class KeyIndex:
    """Thread-safe LRU of value sizes by key digest (at most ``max_keys``), with the key text when known."""

    def __init__(self, max_keys: int, *, evicts_when_full: bool = False) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys}")
        self.max_keys = max_keys
        # True: the caller deletes what record() pushes out (counted as evictions, not here).
        self.evicts_when_full = evicts_when_full
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        # Digests in the order they are next checked; a forgotten digest's slot is skipped when reached.
        self._round: deque[str] = deque()
        self._lock = threading.Lock()
        self._bytes = 0
        self._new = 0  # keys indexed since the last round of checks
        #: Entries forgotten to stay within ``max_keys`` (their values stayed in the server;
        #: never counted when ``evicts_when_full``: those are deleted, as evictions).
        self.dropped_full = 0
        #: Entries dropped because a read, lookup or check found the key gone from the server.
        self.found_gone = 0

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def items(self) -> int:
        with self._lock:
            return len(self._entries)

    def record(self, digest: str, size: int, key: str | None) -> list[tuple[str, str | None]]:
        """``size`` value bytes are stored under ``digest``: now the most recently used.

        Returns the (digest, key) of the entries pushed out to stay within ``max_keys``
        (least recently used first), for the caller to delete when ``evicts_when_full``."""
        pushed: list[tuple[str, str | None]] = []
        with self._lock:
            old = self._entries.pop(digest, None)
            if old is not None:
                self._bytes -= old[0]
                key = key or old[1]
            else:
                self._new += 1
                self._round.append(digest)
            self._entries[digest] = (size, key)
            self._bytes += size
            while len(self._entries) > self.max_keys:
                gone, (dropped, gone_key) = self._entries.popitem(last=False)
                self._bytes -= dropped
                pushed.append((gone, gone_key))
                if not self.evicts_when_full:
                    self.dropped_full += 1
            if len(self._round) > 2 * len(self._entries) + 1024:
                # Keys forgotten and indexed again faster than rounds reach their old slots.
                self._round = deque(self._entries)
        return pushed

    def snapshot(self, digests: list[str]) -> list[Entry | None]:
        """The current entry of each digest, to pass to :meth:`forget_gone` after asking the server."""
        with self._lock:
            return [self._entries.get(digest) for digest in digests]

    def forget_gone(self, digest: str, seen: Entry | None) -> None:
        """The server no longer holds ``digest``: drop it unless recorded again since ``seen`` was taken.

        A put that lands between the server's answer and this call leaves its entry in place."""
        if seen is None:
            return
        with self._lock:
            if self._entries.get(digest) is seen:
                del self._entries[digest]
                self._bytes -= seen[0]
                self.found_gone += 1

    def due_checks(self) -> dict[str, Entry]:
        """The next indexed keys of the round to check against the server, with their entries."""
        with self._lock:
            count = min(len(self._entries), CHECKS_PER_NEW_KEY * self._new + CHECKS_PER_ROUND)
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
            self._round.clear()
            self._bytes = 0
            self._new = 0
