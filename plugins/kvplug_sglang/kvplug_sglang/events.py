"""kvplug events as SGLang KV events (``BlockStored`` / ``BlockRemoved``).

A cache engine reports what it and its tiers did to its own listeners
(``CacheEngine.add_event_listener``), on the thread that did it. A
:class:`KVEventBridge`, one connector's listener, remembers the token ids of the
chunks its connector stored or loaded, and follows, per chunk, which tiers hold it:
a tier's ``stored`` event (sent once the tier holds the chunk: an async tier's write
landed, a promotion written; never for a write dropped, declined or refused) becomes
SGLang's ``BlockStored`` for that tier's medium (one block per chunk, chained by
``parent_block_hash``) when no other tier of that medium held it, and a tier's
``evicted``/``removed`` a ``BlockRemoved`` once no tier of that medium holds it (tiers
told apart by ``KVEvent.tier_id``: two tiers of one type, two ``disk`` folders, are two
holders). It hands them out from ``take()``: the shape SGLang's ``KVEventPublisher`` sends
to routers.

Only chunks its connector stored or loaded are known: a record a persistent tier held before
the process started carries no token ids (a record header holds a digest of the chunk key),
so it is never announced. Of those it keeps the chunks some tier holds, and a bounded few no
tier holds (a write not landed yet, declined or dropped, or a chunk that left every tier):
not every chunk it ever stored or loaded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplug import KVEvent, Medium, StoreKey

#: A tier, unique in its chain (``KVEvent.tier_id``): its type and position.
_TierId = tuple[str | None, int | None]

#: kvplug tier medium (``StorageTier.medium``) -> SGLang ``StorageMedium`` value.
_STORAGE_MEDIUM: dict[Medium, str] = {"memory": "CPU_PINNED", "disk": "DISK", "remote": "EXTERNAL"}


def block_hash(chunk_key: str) -> int:
    """The signed 64-bit block hash SGLang events carry, from a chunk key's hash part."""
    value = int(StoreKey.parse(chunk_key).short(16), 16)
    return value - 2**64 if value >= 2**63 else value


@dataclass(frozen=True)
class _Chunk:
    token_ids: tuple[int, ...]
    parent: int | None
    cache_salt: str | None


class KVEventBridge:
    """Collects SGLang KV events for the chunks one connector stored or loaded.

    ``media``: tier name -> kvplug medium (names not in it count as remote). Memory is
    bounded: at most ``max_tracked`` chunks some tier holds and ``max_events`` untaken events
    are kept; older ones are dropped and counted in ``dropped``. A chunk dropped while a tier
    holds it is told removed from its media then: its later removal could not be told. At most
    ``max_waiting`` chunks no tier holds wait for a tier's ``stored``, the oldest forgotten
    first (nothing was told of them).
    """

    def __init__(
        self,
        media: Mapping[str, Medium] | None = None,
        *,
        max_tracked: int = 65536,
        max_events: int = 65536,
        max_waiting: int = 16384,
    ) -> None:
        self._media = dict(media or {})
        self._chunks: OrderedDict[str, _Chunk] = OrderedDict()  # chunks some tier holds, oldest first
        self._waiting: OrderedDict[str, _Chunk] = OrderedDict()  # chunks no tier holds, oldest first
        self._max_waiting = max_waiting
        self._held: dict[str, set[_TierId]] = {}  # chunk key -> the tiers holding it
        self._events: list[Any] = []
        self._lock = threading.Lock()
        self._max_tracked = max_tracked
        self._max_events = max_events
        self.dropped = 0

    def expect(
        self, keys: Sequence[str], bounds: Sequence[tuple[int, int]], tokens: Sequence[int], cache_salt: str | None
    ) -> None:
        """Remember the token ids of chunks stored or loaded under ``keys``."""
        with self._lock:
            parent: int | None = None
            for key, (start, end) in zip(keys, bounds):
                chunk = _Chunk(tuple(tokens[start:end]), parent, cache_salt)
                if key in self._chunks:
                    self._chunks[key] = chunk
                    self._chunks.move_to_end(key)
                else:
                    self._wait(key, chunk)
                parent = block_hash(key)

    def _hold(self, key: str, chunk: _Chunk) -> None:
        """A tier holds ``key``: tracked among the held chunks, the oldest of which are
        forgotten past ``max_tracked``. Holds ``_lock``."""
        if key in self._chunks:  # already held: it keeps its place (the last expect's)
            return
        self._waiting.pop(key, None)
        self._chunks[key] = chunk
        while len(self._chunks) > self._max_tracked:
            old, _ = self._chunks.popitem(last=False)
            holders = self._held.pop(old, None)
            self.dropped += 1
            if holders:  # its later removal could not be told: a router would believe it held for good
                self._forgotten(old, holders)

    def _wait(self, key: str, chunk: _Chunk) -> None:
        """No tier holds ``key``: it waits for a write to land, the oldest of the waiting
        forgotten past ``max_waiting`` (nothing was told of them). Holds ``_lock``."""
        self._waiting[key] = chunk
        self._waiting.move_to_end(key)
        while len(self._waiting) > self._max_waiting:
            self._waiting.popitem(last=False)

    def observe(self, event: KVEvent) -> None:
        from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

        if event.tier is None:  # the engine's own "stored": handed to its tiers, held by none yet
            return
        medium = self._storage_medium(event.tier)
        new: list[Any] = []
        with self._lock:
            if event.kind == "stored":
                for key in event.keys:
                    info = self._chunks.get(key) or self._waiting.get(key)
                    if info is None:
                        continue
                    self._hold(key, info)
                    held = self._held.setdefault(key, set())
                    if medium not in self._media_of(held):
                        new.append(
                            BlockStored(
                                block_hashes=[block_hash(key)],
                                parent_block_hash=info.parent,
                                token_ids=list(info.token_ids),
                                block_size=len(info.token_ids),
                                lora_id=None,
                                medium=medium,
                                cache_salt=info.cache_salt,
                            )
                        )
                    held.add(event.tier_id)
            elif event.kind in ("evicted", "removed"):
                gone = []
                for key in event.keys:
                    holders = self._held.get(key)
                    if holders is None or event.tier_id not in holders:
                        continue
                    holders.discard(event.tier_id)
                    if medium not in self._media_of(holders):
                        gone.append(key)
                    if not holders:  # it left every tier: it waits, as a write may land again
                        del self._held[key]
                        self._wait(key, self._chunks.pop(key))
                if gone:
                    new.append(BlockRemoved(block_hashes=[block_hash(k) for k in gone], medium=medium))
            self._events.extend(new)
            self._bound_events()

    def _bound_events(self) -> None:
        """Drop the oldest untaken events past ``max_events`` (counted). Holds ``_lock``."""
        overflow = len(self._events) - self._max_events
        if overflow > 0:
            del self._events[:overflow]
            self.dropped += overflow

    def _forgotten(self, key: str, holders: set[_TierId]) -> None:
        """Tell routers a chunk no longer tracked is removed from every medium holding it (a
        later store or load of it announces it again). Holds ``_lock``."""
        from sglang.srt.disaggregation.kv_events import BlockRemoved

        for medium in sorted(self._media_of(holders)):
            self._events.append(BlockRemoved(block_hashes=[block_hash(key)], medium=medium))

    def _media_of(self, tiers: set[_TierId]) -> set[str]:
        return {self._storage_medium(tier) for tier, _ in tiers if tier is not None}

    def _storage_medium(self, tier: str) -> str:
        return _STORAGE_MEDIUM[self._media.get(tier, "remote")]

    def take(self) -> list[Any]:
        """Events since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events
