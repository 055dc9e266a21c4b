"""Eviction policies a byte-bounded tier shares: which stored keys leave first.

A policy orders keys and sizes only; the tier (its owner) keeps the values and its own
byte count, tells the policy what happened (:meth:`EvictionPolicy.inserted`,
:meth:`~EvictionPolicy.accessed`, :meth:`~EvictionPolicy.removed`) and, when over its
budget, takes victims (:meth:`~EvictionPolicy.pop_victim`, :meth:`~EvictionPolicy.victims`)
and drops them. Every operation is O(1), amortised for ``s3fifo``.

Policies are not thread-safe: the owner calls them under the lock that guards its own
entries (the cpu tier's, :class:`~kvplug.core.records.index.RecordIndex`'s).

- ``lru``: least recently used first; an insert or an access makes a key the most recent.
- ``s3fifo``: S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction",
  SOSP 2023), scan-resistant: new keys enter a small FIFO (about a tenth of the bytes);
  a key read at least twice while there moves on to the main FIFO, others leave and are
  remembered in a ghost FIFO of keys (no sizes), and a key stored again while remembered
  enters main directly. Main is a clock with a 2-bit frequency: a key read since it was
  last passed is reinserted with its count lowered by one. A scan of one-off keys thus
  goes through the small queue only and leaves main's working set in place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import ClassVar, Literal

#: The names a tier's ``eviction`` option takes.
EvictionName = Literal["lru", "s3fifo"]


class EvictionPolicy(ABC):
    """Chooses which keys a byte-bounded store drops first (not thread-safe: see the module)."""

    name: ClassVar[str]

    @abstractmethod
    def inserted(self, key: str, size: int, *, cold: bool = False) -> None:
        """``key`` now holds ``size`` bytes. A key already held takes the new size and
        counts as accessed. ``cold``: a key found rather than stored (a start-up listing),
        entering as the least valuable of all, the first to leave."""

    @abstractmethod
    def accessed(self, key: str) -> None:
        """``key`` was read (a hit). Unknown keys are ignored."""

    @abstractmethod
    def removed(self, key: str) -> None:
        """The owner dropped ``key`` itself (not a victim of this policy). Unknown keys are ignored."""

    @abstractmethod
    def pop_victim(self) -> tuple[str, int] | None:
        """The next key to evict and its size, no longer held by the policy; ``None`` when empty."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @property
    @abstractmethod
    def bytes_used(self) -> int:
        """The sum of the held keys' sizes."""

    def victims(self, nbytes: int) -> list[tuple[str, int]]:
        """Pop victims until at least ``nbytes`` are freed or nothing is left, in eviction order."""
        chosen: list[tuple[str, int]] = []
        freed = 0
        while freed < nbytes:
            victim = self.pop_victim()
            if victim is None:
                break
            chosen.append(victim)
            freed += victim[1]
        return chosen

    def state(self) -> dict[str, int]:
        """Figures for a tier's ``stats().extra`` (queue lengths and bytes)."""
        return {"items": len(self), "bytes": self.bytes_used}


class LRUPolicy(EvictionPolicy):
    """Least recently used first: an ordered map from key to size."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0

    def inserted(self, key: str, size: int, *, cold: bool = False) -> None:
        old = self._order.pop(key, None)
        if old is not None:
            self._bytes -= old
        self._order[key] = size
        self._bytes += size
        if cold:
            self._order.move_to_end(key, last=False)

    def accessed(self, key: str) -> None:
        try:  # (cheaper than a membership test first on this hot path)
            self._order.move_to_end(key)
        except KeyError:
            pass

    def removed(self, key: str) -> None:
        size = self._order.pop(key, None)
        if size is not None:
            self._bytes -= size

    def pop_victim(self) -> tuple[str, int] | None:
        if not self._order:
            return None
        key, size = self._order.popitem(last=False)
        self._bytes -= size
        return key, size

    def clear(self) -> None:
        self._order.clear()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def order(self) -> list[str]:
        """The held keys, the next victim first (for tests and displays: O(n))."""
        return list(self._order)


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO: a small FIFO, a main FIFO with 2-bit frequencies and a ghost FIFO of keys.

    As in the paper's algorithm, the small queue is evicted from while it holds at least
    :attr:`SMALL_SHARE` of the bytes, else the main queue. The paper evicts before it
    inserts; owners here insert and then take victims, so that decision leaves out the
    key inserted last (it is not evicted in its own insert unless nothing else is held
    in either queue). The ghost queue keeps at most :attr:`GHOST_SHARE` as many keys as
    are held (the main queue's share, the paper's "as many entries as main"), at least one.
    """

    name = "s3fifo"
    #: The small queue's share of the bytes held.
    SMALL_SHARE = 0.1
    #: The ghost queue's bound, as a share of the number of keys held.
    GHOST_SHARE = 0.9
    #: Reads in the small queue that move a key on to the main queue (the paper's ``freq > 1``).
    PROMOTE_AT = 2
    #: The frequency's cap (two bits).
    MAX_FREQ = 3

    def __init__(self) -> None:
        self._small: OrderedDict[str, int] = OrderedDict()
        self._main: OrderedDict[str, int] = OrderedDict()
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._freq: dict[str, int] = {}
        self._small_bytes = 0
        self._main_bytes = 0
        self._fresh: str | None = None  # the key inserted last into the small queue

    def inserted(self, key: str, size: int, *, cold: bool = False) -> None:
        freq = self._freq.get(key)
        if freq is not None:  # held: a new size, and an access
            if key in self._small:
                self._small_bytes += size - self._small[key]
                self._small[key] = size
            else:
                self._main_bytes += size - self._main[key]
                self._main[key] = size
            self._freq[key] = min(freq + 1, self.MAX_FREQ)
            return
        self._freq[key] = 0
        remembered = key in self._ghost
        if remembered:
            del self._ghost[key]
        self._fresh = None
        if cold:
            self._small[key] = size
            self._small.move_to_end(key, last=False)
            self._small_bytes += size
        elif remembered:
            self._main[key] = size
            self._main_bytes += size
        else:
            self._small[key] = size
            self._small_bytes += size
            self._fresh = key

    def accessed(self, key: str) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < self.MAX_FREQ:
            self._freq[key] = freq + 1

    def removed(self, key: str) -> None:
        self._ghost.pop(key, None)
        if self._freq.pop(key, None) is None:
            return
        size = self._small.pop(key, None)
        if size is not None:
            self._small_bytes -= size
        else:
            self._main_bytes -= self._main.pop(key)
        self._trim_ghost()

    def pop_victim(self) -> tuple[str, int] | None:
        # Terminates: each turn evicts, moves a key from small to main (once per insert) or
        # lowers a main key's frequency (at most MAX_FREQ per access): amortised O(1).
        while self._freq:
            if self._small_turn():
                key, size = self._small.popitem(last=False)
                self._small_bytes -= size
                if self._freq[key] >= self.PROMOTE_AT:
                    self._freq[key] = 0  # its reads are cleared on the move
                    self._main[key] = size
                    self._main_bytes += size
                    continue
                del self._freq[key]
                self._ghost[key] = None
                self._trim_ghost()
                return key, size
            key, size = self._main.popitem(last=False)
            freq = self._freq[key]
            if freq > 0:
                self._freq[key] = freq - 1
                self._main[key] = size
                continue
            self._main_bytes -= size
            del self._freq[key]
            self._trim_ghost()
            return key, size
        return None

    def _small_turn(self) -> bool:
        """Whether the next victim comes from the small queue."""
        if not self._small:
            return False
        if not self._main:
            return True
        small_bytes = self._small_bytes
        if self._fresh is not None and self._fresh in self._small:
            if len(self._small) == 1:
                return False  # only the key just inserted: the paper would not see it yet
            small_bytes -= self._small[self._fresh]
        return small_bytes >= self.SMALL_SHARE * (self._small_bytes + self._main_bytes)

    def _trim_ghost(self) -> None:
        bound = max(1, int(self.GHOST_SHARE * len(self._freq)))
        while len(self._ghost) > bound:
            self._ghost.popitem(last=False)

    def clear(self) -> None:
        self._small.clear()
        self._main.clear()
        self._ghost.clear()
        self._freq.clear()
        self._small_bytes = self._main_bytes = 0
        self._fresh = None

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    @property
    def bytes_used(self) -> int:
        return self._small_bytes + self._main_bytes

    def state(self) -> dict[str, int]:
        return {
            "items": len(self._freq),
            "bytes": self.bytes_used,
            "small_items": len(self._small),
            "small_bytes": self._small_bytes,
            "main_items": len(self._main),
            "main_bytes": self._main_bytes,
            "ghost_items": len(self._ghost),
        }


_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}


def make_eviction_policy(name: str) -> EvictionPolicy:
    """A new, empty policy of the given name (``lru`` or ``s3fifo``)."""
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction policy {name!r} is not one of {sorted(_POLICIES)}") from None
