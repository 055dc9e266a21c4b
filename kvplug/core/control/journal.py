"""What ``clear`` can name: :class:`ChunkJournal`, the keys a cache stored or loaded that some tier may still hold.

A control target's journal hears its engine's events (``stored`` without a tier: handed to the
tiers; ``loaded``), its tiers' events (``stored`` with a tier index: the tier holds the key;
``evicted`` / ``removed``: it left that tier) and its chain's own writes (:meth:`ChunkJournal.on_written`,
which tier this cache's writes put each key in). It keeps a key while some tier of the chain may
hold it, and a bounded few no tier holds (``max_waiting``): a write not landed yet, which
``clear`` must cancel, or one that never will land. Past ``max_waiting`` the oldest whose write
can no longer land (``in_flight``: :meth:`CacheEngine.writes_in_flight
<kvplug.CacheEngine.writes_in_flight>`) are forgotten first, as :class:`~kvplug.HeldChunks` does
(:func:`~kvplug.core.held_chunks.forget_landed`): no tier holds them, so ``clear`` loses nothing.

Events arrive in any order: a sync tier's ``stored`` and the chain's write notice come before the
engine's own ``stored``, a promotion's write before its ``loaded``. So any of them makes an entry;
one that no engine event names (a manifest, a promoted record of another head group) is not listed
by :meth:`ChunkJournal.split`, and is forgotten like any other once no tier holds it.

A tier whose evictions nobody reports (a shared valkey's own LRU, an S3 lifecycle rule, another
engine evicting from a shared folder) never says a key left it: such keys stay held until
``max_held`` (the oldest forgotten first, counted in ``forgotten``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence

from kvplug.core.events import KVEvent
from kvplug.core.held_chunks import MAX_WAITING, forget_landed

#: Keys some tier may hold that a journal remembers at most (oldest forgotten first): bounds its
#: memory where a tier's evictions are never reported.
MAX_JOURNAL_CHUNKS = 1 << 20

_STORED = 1
_LOADED = 2
_TIER_BITS = 2  # bit _TIER_BITS + i: this cache's chain wrote the key to tier i


class ChunkJournal:
    """The keys a cache stored or loaded (from its events) that some tier of its chain may still
    hold, newest last, and for each the tiers its own writes put it in (:meth:`on_written`); at
    most ``max_held`` held and ``max_waiting`` (plus the writes in flight) that no tier holds.
    Thread-safe: events come from store, queue and removal threads. See the module docstring."""

    def __init__(
        self,
        max_held: int = MAX_JOURNAL_CHUNKS,
        *,
        max_waiting: int = MAX_WAITING,
        in_flight: Callable[[Sequence[str]], list[bool]] | None = None,
        hears_tiers: bool = True,
    ) -> None:
        if max_held < 1 or max_waiting < 0:
            raise ValueError(f"ChunkJournal needs max_held >= 1 and max_waiting >= 0, got {max_held}, {max_waiting}")
        self.max_held = max_held
        self.max_waiting = max_waiting
        #: Whether a write of each key may still land (None: none may): those are kept waiting.
        self.in_flight = in_flight
        #: Whether its tiers' events reach :meth:`on_event`. A journal that hears none cannot
        #: tell which keys a tier holds: it keeps every key, up to ``max_held``.
        self.hears_tiers = hears_tiers
        #: Keys dropped past ``max_held`` while a tier may still hold them: ``clear`` cannot name them.
        self.forgotten = 0
        self._keys: OrderedDict[str, int] = OrderedDict()  # key -> _STORED | _LOADED | tier bits, oldest first
        self._holders: dict[str, int] = {}  # key -> bit i: tier i holds it (its "stored"); never 0
        self._waiting: OrderedDict[str, None] = OrderedDict()  # keys of _keys no tier holds, oldest first
        self._lock = threading.Lock()

    def on_event(self, event: KVEvent) -> None:
        """An engine's or its tiers' event (an engine listener)."""
        if event.tier is None:
            if event.kind == "stored":
                self.stored(event.keys)
            elif event.kind == "loaded":
                self._note(event.keys, _LOADED)
        elif event.tier_index is not None and event.kind == "stored":
            self._held_by(event.keys, event.tier_index)
        elif event.tier_index is not None and event.kind in ("evicted", "removed"):
            self._left(event.keys, event.tier_index)

    def on_written(self, tier: int, keys: Sequence[str]) -> None:
        """The chain wrote ``keys`` to its tier at index ``tier`` (a :class:`~kvplug.core.chain.slot.WriteListeners` listener).
        Whether the tier kept them its own ``stored`` says (a tier over its budget may refuse)."""
        self._note(keys, 1 << (_TIER_BITS + tier))

    def stored(self, keys: Sequence[str]) -> None:
        """Note ``keys`` as stored by this cache (what its ``stored`` events say)."""
        self._note(keys, _STORED)

    def _note(self, keys: Sequence[str], bits: int) -> None:
        with self._lock:
            for key in keys:
                self._keys[key] = self._keys.get(key, 0) | bits
                self._keys.move_to_end(key)
                if self.hears_tiers and key not in self._holders:
                    self._wait(key)
            self._trim()

    def _held_by(self, keys: Sequence[str], tier: int) -> None:
        with self._lock:
            for key in keys:
                if key not in self._keys:  # before the engine's event or the write notice: see the module docstring
                    self._keys[key] = 0
                self._holders[key] = self._holders.get(key, 0) | 1 << tier
                self._waiting.pop(key, None)
            self._trim()

    def _left(self, keys: Sequence[str], tier: int) -> None:
        with self._lock:
            for key in keys:
                holders = self._holders.get(key, 0) & ~(1 << tier)
                if holders:
                    self._holders[key] = holders
                elif self._holders.pop(key, None) is not None:  # it left every tier: it waits (written again?)
                    self._wait(key, writing=False)

    def _wait(self, key: str, *, writing: bool = True) -> None:
        """``key`` (in ``_keys``) is held by no tier: it waits, the oldest whose write cannot land
        forgotten. ``writing``: it was just stored or written, its tier's ``stored`` may come next."""
        self._waiting[key] = None
        self._waiting.move_to_end(key)
        newest = key if writing else None
        for old in forget_landed(self._waiting, self.max_waiting, self.in_flight, newest=newest):
            del self._keys[old]

    def _trim(self) -> None:
        """Past ``max_held`` keys some tier may hold, the oldest are forgotten (and counted)."""
        excess = len(self._keys) - len(self._waiting) - self.max_held
        if excess <= 0:
            return
        # Not a copy of every key: the waiting ones met before the oldest held are at most
        # max_waiting plus the writes in flight.
        oldest: list[str] = []
        for key in self._keys:
            if key not in self._waiting:
                oldest.append(key)
                if len(oldest) == excess:
                    break
        for key in oldest:
            del self._keys[key]
            self._holders.pop(key, None)
        self.forgotten += len(oldest)

    def __len__(self) -> int:
        """Keys remembered: held by some tier, or waiting."""
        return len(self._keys)

    def held_count(self) -> int:
        """Keys some tier holds (as its events said)."""
        return len(self._holders)

    def waiting_count(self) -> int:
        """Keys remembered that no tier holds."""
        return len(self._waiting)

    def keys(self, prefix: str = "") -> list[str]:
        """Every key stored or loaded that starts with ``prefix``."""
        stored, loaded = self.split(prefix)
        return stored + loaded

    def split(self, prefix: str = "") -> tuple[list[str], list[str]]:
        """The keys starting with ``prefix`` that this cache stored, and those it only loaded."""
        stored: list[str] = []
        loaded: list[str] = []
        with self._lock:
            for key, bits in self._keys.items():
                if key.startswith(prefix) and bits & (_STORED | _LOADED):
                    (stored if bits & _STORED else loaded).append(key)
        return stored, loaded

    def written_to(self, keys: Sequence[str]) -> Mapping[int, Sequence[str]]:
        """Per tier index, which of ``keys`` this cache's chain wrote there, read when asked:
        a removal asks after cancelling queued writes, so a write that landed meanwhile counts."""
        return _WrittenTo(self, list(keys))

    def written_now(self, keys: Sequence[str]) -> dict[int, list[str]]:
        """Per tier index, which of ``keys`` this cache's chain has written there so far."""
        found: dict[int, list[str]] = {}
        with self._lock:
            for key in keys:
                tiers, index = self._keys.get(key, 0) >> _TIER_BITS, 0
                while tiers:
                    if tiers & 1:
                        found.setdefault(index, []).append(key)
                    tiers, index = tiers >> 1, index + 1
        return found

    def forget(self, keys: Sequence[str]) -> None:
        """``keys`` were cleared from every tier."""
        with self._lock:
            for key in keys:
                self._keys.pop(key, None)
                self._holders.pop(key, None)
                self._waiting.pop(key, None)


class _WrittenTo(Mapping[int, Sequence[str]]):
    """:meth:`ChunkJournal.written_to`: a view of the journal, not a copy."""

    def __init__(self, journal: ChunkJournal, keys: list[str]) -> None:
        self._journal = journal
        self._keys = keys

    def __getitem__(self, index: int) -> Sequence[str]:
        return self._journal.written_now(self._keys)[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._journal.written_now(self._keys))

    def __len__(self) -> int:
        return len(self._journal.written_now(self._keys))
