"""Which chunks some tier holds, per medium: what an engine adapter tells cache-aware routers.

A cache-aware router learns what a server holds from ``BlockStored`` /
``BlockRemoved`` events, each naming a medium. kvplug's tiers report what they did
(:class:`~kvplug.KVEvent`): a tier's ``stored`` once it holds a chunk, its ``evicted`` /
``removed`` once the chunk left it. :class:`HeldChunks` follows, for the chunks an adapter
stored or loaded (``expect``), which tiers hold each one, and turns each tier event into the
changes routers must hear of, in order: a chunk first held on a medium, a chunk no tier of a
medium holds any more, a chunk no longer followed. The adapter turns those into its engine's
event types; the core names no engine.

Memory is bounded. At most ``max_held`` chunks some tier holds are followed: past it the oldest
is forgotten and reported (``forgotten``), with the media that held it, since its later
eviction could no longer be told and a router would believe it held for good. At most
``max_waiting`` chunks no tier holds (a write not landed yet, declined or dropped, or a chunk
that left every tier) wait for a tier's ``stored``, the oldest forgotten first: nothing was
told of them. A ``stored`` of a chunk no longer (or never) expected names nothing routers can
use (a router needs the chunk's tokens, which a tier's record does not carry), so it is
counted in ``unknown_stored`` and not announced: a router would miss that hit for as long as
the tier holds it. So, given ``in_flight`` (:meth:`CacheEngine.writes_in_flight
<kvplug.CacheEngine.writes_in_flight>`), the chunks forgotten past ``max_waiting`` are the
oldest whose write can no longer land (dropped, declined, refused, failed, or none was made);
one whose write is still queued is kept until it lands or is given up, so the chunks waiting
are at most ``max_waiting`` plus the writes in flight, which the write queues bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Generic, Literal, TypeVar

from kvplug.core.events import KVEvent

#: What an adapter remembers of a chunk to name it to routers (its tokens, its engine's block hashes).
ChunkT = TypeVar("ChunkT")

#: A tier, unique in its chain (:attr:`KVEvent.tier_id`): its type and position.
TierId = tuple[str | None, int | None]

#: Chunks some tier holds followed at most by default (oldest forgotten first).
MAX_HELD = 1 << 20
#: Chunks no tier holds remembered at most by default (oldest forgotten first).
MAX_WAITING = 1 << 14
#: Waiting chunks asked about at most at once, oldest first, when some are to be forgotten.
_SCAN = 64


@dataclass(frozen=True)
class HeldChange(Generic[ChunkT]):
    """One thing routers must be told of a chunk.

    - ``stored``: a tier of ``medium`` now holds it; ``first`` when no other tier of that
      medium held it before (an adapter that tells each medium once announces only those).
    - ``removed``: no tier of ``medium`` holds it any more.
    - ``forgotten``: it is no longer followed (``max_held``); ``media`` held it until now.
    """

    kind: Literal["stored", "removed", "forgotten"]
    key: str
    chunk: ChunkT
    medium: str | None = None
    first: bool = False
    media: tuple[str, ...] = ()


class HeldChunks(Generic[ChunkT]):
    """Chunk key -> what names it to routers, for chunks some tier holds and a bounded few waiting.

    ``medium_of(tier)`` maps a tier's type (:attr:`KVEvent.tier`) to the medium routers are
    told; two tiers of one medium are told apart by :attr:`KVEvent.tier_id`, so one of them
    evicting a chunk the other holds does not remove it from the medium. Not thread-safe: an
    adapter calls it under its own lock, the same one it queues the resulting events under, so
    the events leave in the order the tiers' states changed.
    """

    def __init__(
        self,
        medium_of: Callable[[str], str],
        *,
        max_held: int = MAX_HELD,
        max_waiting: int = MAX_WAITING,
        in_flight: Callable[[Sequence[str]], list[bool]] | None = None,
    ) -> None:
        if max_held < 1 or max_waiting < 0:
            raise ValueError(f"HeldChunks needs max_held >= 1 and max_waiting >= 0, got {max_held}, {max_waiting}")
        self._medium_of = medium_of
        self._in_flight = in_flight
        self.max_held = max_held
        self.max_waiting = max_waiting
        self._held: OrderedDict[str, ChunkT] = OrderedDict()  # oldest first
        self._waiting: OrderedDict[str, ChunkT] = OrderedDict()  # oldest first
        self._holders: dict[str, set[TierId]] = {}  # of each held chunk: never empty
        #: ``stored`` events of chunks not expected (forgotten, or never stored or loaded here).
        self.unknown_stored = 0

    def expect(self, key: str, chunk: ChunkT) -> None:
        """Remember how to name ``key`` (the adapter stored or loaded it): a held chunk takes the
        new name and becomes the newest; any other waits for a tier's ``stored``."""
        if key in self._held:
            self._held[key] = chunk
            self._held.move_to_end(key)
        else:
            self._wait(key, chunk)

    def observe(self, event: KVEvent) -> list[HeldChange[ChunkT]]:
        """The changes routers must hear of for a tier's event, in order (none for an event of
        no tier: the engine's own ``stored`` only says it handed chunks to its tiers)."""
        if event.tier is None:
            return []
        medium = self._medium_of(event.tier)
        changes: list[HeldChange[ChunkT]] = []
        if event.kind == "stored":
            for key in event.keys:
                chunk = self._held.get(key)
                if chunk is None:
                    chunk = self._waiting.pop(key, None)
                    if chunk is None:
                        self.unknown_stored += 1
                        continue
                    changes += self._hold(key, chunk)
                holding = self._holders.setdefault(key, set())
                first = medium not in self._media(holding)
                holding.add(event.tier_id)
                changes.append(HeldChange("stored", key, chunk, medium=medium, first=first))
        elif event.kind in ("evicted", "removed"):
            for key in event.keys:
                holders = self._holders.get(key)
                if holders is None or event.tier_id not in holders:
                    continue  # never said held there: nothing to take back
                holders.discard(event.tier_id)
                chunk = self._held[key]
                if medium not in self._media(holders):
                    changes.append(HeldChange("removed", key, chunk, medium=medium))
                if not holders:  # it left every tier: it waits, as a write may land again
                    del self._holders[key]
                    self._wait(key, self._held.pop(key))
        return changes

    def held_keys(self) -> list[str]:
        """The chunks some tier holds, oldest first."""
        return list(self._held)

    def waiting_keys(self) -> list[str]:
        """The chunks remembered that no tier holds, oldest first."""
        return list(self._waiting)

    def holders(self, key: str) -> set[TierId]:
        """The tiers that hold ``key`` (empty if none, or not followed)."""
        return set(self._holders.get(key, ()))

    def _hold(self, key: str, chunk: ChunkT) -> list[HeldChange[ChunkT]]:
        """``key`` is held: followed among the held chunks, the oldest forgotten past ``max_held``."""
        self._held[key] = chunk
        forgotten = []
        while len(self._held) > self.max_held:
            old, old_chunk = self._held.popitem(last=False)
            media = self._media(self._holders.pop(old, set()))
            forgotten.append(HeldChange("forgotten", old, old_chunk, media=tuple(sorted(media))))
        return forgotten

    def _wait(self, key: str, chunk: ChunkT) -> None:
        """No tier holds ``key``: it waits, the oldest waiting whose write cannot land any more
        forgotten past ``max_waiting``."""
        self._waiting[key] = chunk
        self._waiting.move_to_end(key)
        forget_landed(self._waiting, self.max_waiting, self._in_flight, newest=key)

    def _media(self, tiers: Iterable[TierId]) -> set[str]:
        return {self._medium_of(tier) for tier, _ in tiers if tier is not None}


def forget_landed(
    waiting: OrderedDict[str, Any],
    max_waiting: int,
    in_flight: Callable[[Sequence[str]], list[bool]] | None,
    *,
    newest: str | None = None,
) -> list[str]:
    """Trim ``waiting`` (keys no tier holds, oldest first) toward ``max_waiting``: forget the
    oldest whose write can no longer land (``in_flight`` says which may; ``None``: none may),
    and return them. One whose write may still land is kept, moved behind the others, so the
    keys left are at most ``max_waiting`` plus the writes in flight. At most ``_SCAN`` keys are
    asked about per call (a deep write queue costs no call more than that); ``newest`` (the key
    just added: its write comes next) is not asked about."""
    excess = len(waiting) - max_waiting
    if excess <= 0:
        return []
    if in_flight is None:
        return [waiting.popitem(last=False)[0] for _ in range(excess)]
    forgotten: list[str] = []
    oldest = [old for old in islice(waiting, _SCAN + 1) if old != newest][:_SCAN]
    for old, landing in zip(oldest, in_flight(oldest)):
        if landing:  # its write may still land: kept, behind the others
            waiting.move_to_end(old)
        elif len(forgotten) < excess:
            del waiting[old]
            forgotten.append(old)
    return forgotten
