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
so it is not announced at start, and a load of it is announced for the faster tiers it is
promoted to, not for the tier that served it (that tier wrote nothing). Of those it keeps the chunks some tier holds, and a bounded few no
tier holds (a write not landed yet, declined or dropped, or a chunk that left every tier):
not every chunk it ever stored or loaded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplug import HeldChunks, KVEvent, Medium, StoreKey

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

    ``media``: tier name -> kvplug medium (names not in it count as remote). Which tiers hold
    which chunk is kvplug's :class:`~kvplug.HeldChunks` (media: SGLang's storage media).
    Memory is bounded: at most ``max_tracked`` chunks some tier holds and ``max_events``
    untaken events (and the removals of blocks told stored, at most one each) are kept: past it the oldest ``BlockStored`` are dropped, with their later
    ``BlockRemoved`` (never a removal of a block told stored), counted in ``dropped``. A chunk dropped
    while a tier holds it is told removed from its media then: its later removal could not be
    told. At most ``max_waiting`` chunks no tier holds wait for a tier's ``stored``, the oldest
    whose write can no longer land (``in_flight``) forgotten first (nothing was told of them).
    """

    def __init__(
        self,
        media: Mapping[str, Medium] | None = None,
        *,
        max_tracked: int = 65536,
        max_events: int = 65536,
        max_waiting: int = 16384,
        in_flight: Callable[[Sequence[str]], list[bool]] | None = None,
    ) -> None:
        """``in_flight``: the cache engine's ``writes_in_flight`` (see :class:`~kvplug.HeldChunks`)."""
        self._media = dict(media or {})
        self.chunks: HeldChunks[_Chunk] = HeldChunks(
            self._storage_medium, max_held=max_tracked, max_waiting=max_waiting, in_flight=in_flight
        )
        self._events: list[Any] = []
        self._lock = threading.Lock()
        self._max_events = max_events
        self.dropped = 0
        #: (block, medium) of the untaken ``BlockStored`` dropped, until their removal is (see _bound_events).
        self._untold: dict[tuple[int, str | None], bool] = {}

    def expect(
        self, keys: Sequence[str], bounds: Sequence[tuple[int, int]], tokens: Sequence[int], cache_salt: str | None
    ) -> None:
        """Remember the token ids of chunks stored or loaded under ``keys``."""
        with self._lock:
            parent: int | None = None
            for key, (start, end) in zip(keys, bounds):
                self.chunks.expect(key, _Chunk(tuple(tokens[start:end]), parent, cache_salt))
                parent = block_hash(key)

    def observe(self, event: KVEvent) -> None:
        from sglang.srt.disaggregation.kv_events import BlockStored

        with self._lock:
            gone: list[int] = []
            for change in self.chunks.observe(event):
                info = change.chunk
                if change.kind == "forgotten":  # its later removal could not be told
                    self.dropped += 1
                    for medium in change.media:
                        self._removed([block_hash(change.key)], medium)
                elif change.kind == "stored":
                    if change.first:  # each medium is told once
                        self._events.append(
                            BlockStored(
                                block_hashes=[block_hash(change.key)],
                                parent_block_hash=info.parent,
                                token_ids=list(info.token_ids),
                                block_size=len(info.token_ids),
                                lora_id=None,
                                medium=change.medium,
                                cache_salt=info.cache_salt,
                            )
                        )
                else:  # one event's removals from one medium: one BlockRemoved
                    gone.append(block_hash(change.key))
            if gone:
                self._removed(gone, self._storage_medium(event.tier or ""))
            self._bound_events()

    def _removed(self, blocks: Sequence[int], medium: str | None) -> None:
        """Queue a ``BlockRemoved`` of ``blocks`` from ``medium``, less those whose ``BlockStored``
        was dropped untaken (no router heard them stored). Holds ``_lock``."""
        from sglang.srt.disaggregation.kv_events import BlockRemoved

        told = [block for block in blocks if not self._untold.pop((block, medium), False)]
        if not told:
            self.dropped += 1
        else:
            self._events.append(BlockRemoved(block_hashes=told, medium=medium))

    def _bound_events(self) -> None:
        """Drop the oldest untaken ``BlockStored`` events past ``max_events`` (counted), and the
        removals of the blocks they told, queued or to come (:meth:`_removed`): never a removal
        of a block a router may have heard stored (it would believe the block held for good).
        Those removals are kept past the bound: at most one per block told stored and medium
        (``max_tracked`` per medium). Holds ``_lock``."""
        from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

        overflow = len(self._events) - self._max_events
        if overflow <= 0:
            return
        queued, self._events = self._events, []
        for event in queued:
            if overflow > 0 and isinstance(event, BlockStored):
                overflow -= 1
                self.dropped += 1
                self._untold.update({(block, event.medium): True for block in event.block_hashes})
            elif isinstance(event, BlockRemoved) and self._untold:
                self._removed(event.block_hashes, event.medium)
            else:
                self._events.append(event)
        while len(self._untold) > self._max_events:  # the oldest: their removals are sent (a no-op)
            del self._untold[next(iter(self._untold))]

    def _storage_medium(self, tier: str) -> str:
        return _STORAGE_MEDIUM[self._media.get(tier, "remote")]

    def take(self) -> list[Any]:
        """Events since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
            self._untold.clear()  # a removal taken later of a block never told stored is a no-op
        return events
