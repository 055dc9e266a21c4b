"""kvplug events as SGLang KV events (``BlockStored`` / ``BlockRemoved``).

A cache engine reports what it and its tiers did to its own listeners
(``CacheEngine.add_event_listener``), on the thread that did it. A
:class:`KVEventBridge`, one connector's listener, remembers the token ids of the
chunks its connector queued, turns the matching ``stored`` events into SGLang's
``BlockStored`` (one block per chunk, chained by ``parent_block_hash``) and
``evicted``/``removed`` events into ``BlockRemoved``, and hands them out from
``take()``: the shape SGLang's ``KVEventPublisher`` sends to routers.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplug import KVEvent, Medium, StoreKey

#: kvplug tier medium (``StorageTier.medium``) -> SGLang ``StorageMedium`` value.
_STORAGE_MEDIUM: dict[Medium, str] = {"memory": "CPU_PINNED", "disk": "DISK", "remote": "EXTERNAL"}


def block_hash(chunk_key: str) -> int:
    """The signed 64-bit block hash SGLang events carry, from a chunk key's hash part."""
    value = int(StoreKey.parse(chunk_key).short(16), 16)
    return value - 2**64 if value >= 2**63 else value


@dataclass(frozen=True)
class _Pending:
    token_ids: tuple[int, ...]
    parent: int | None
    cache_salt: str | None


class KVEventBridge:
    """Collects SGLang KV events for the chunks one connector stored.

    Memory is bounded: at most ``max_tracked`` queued-but-unconfirmed chunks and
    ``max_events`` untaken events are kept; older ones are dropped and counted.
    """

    def __init__(
        self,
        first_tier: str,
        media: Mapping[str, Medium] | None = None,
        *,
        max_tracked: int = 65536,
        max_events: int = 65536,
    ) -> None:
        #: Tier type -> medium (types not in it count as remote): events name media, not tiers.
        self._media = dict(media or {})
        self._medium = self._storage_medium(first_tier)
        self._pending: dict[str, _Pending] = {}
        self._stored: dict[str, None] = {}  # insertion-ordered set of confirmed keys
        self._events: list[Any] = []
        self._lock = threading.Lock()
        self._max_tracked = max_tracked
        self._max_events = max_events
        self.dropped = 0

    def expect(
        self, keys: Sequence[str], bounds: Sequence[tuple[int, int]], tokens: Sequence[int], cache_salt: str | None
    ) -> None:
        """Remember the token ids of chunks about to be stored under ``keys``."""
        with self._lock:
            parent: int | None = None
            for key, (start, end) in zip(keys, bounds):
                if key not in self._stored:
                    self._pending[key] = _Pending(tuple(tokens[start:end]), parent, cache_salt)
                parent = block_hash(key)
            while len(self._pending) > self._max_tracked:
                self._pending.pop(next(iter(self._pending)))
                self.dropped += 1

    def observe(self, event: KVEvent) -> None:
        from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

        new: list[Any] = []
        with self._lock:
            if event.kind == "stored":
                for key in event.keys:
                    info = self._pending.pop(key, None)
                    if info is None:
                        continue
                    self._stored[key] = None
                    new.append(
                        BlockStored(
                            block_hashes=[block_hash(key)],
                            parent_block_hash=info.parent,
                            token_ids=list(info.token_ids),
                            block_size=len(info.token_ids),
                            lora_id=None,
                            medium=self._medium,
                            cache_salt=info.cache_salt,
                        )
                    )
                while len(self._stored) > self._max_tracked:
                    self._stored.pop(next(iter(self._stored)))
            elif event.kind in ("evicted", "removed"):
                gone = [key for key in event.keys if key in self._stored]
                if gone:
                    medium = self._storage_medium(event.tier or "")
                    new.append(BlockRemoved(block_hashes=[block_hash(k) for k in gone], medium=medium))
                    if event.kind == "removed":
                        for key in gone:
                            self._stored.pop(key, None)
            self._events.extend(new)
            overflow = len(self._events) - self._max_events
            if overflow > 0:
                del self._events[:overflow]
                self.dropped += overflow

    def _storage_medium(self, tier: str) -> str:
        return _STORAGE_MEDIUM[self._media.get(tier, "remote")]

    def take(self) -> list[Any]:
        """Events since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events
