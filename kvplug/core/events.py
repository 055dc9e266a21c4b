"""Events: what happened to KV chunks, and who hears of it.

Each :class:`~kvplug.CacheEngine` hands its events (its stores and loads, its tiers'
evictions and removals) to its own listeners (:meth:`CacheEngine.add_event_listener`),
so two engines in one process never see each other's events, and to the process-wide
``kvplug_on_event`` hook, whose observers see every engine's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvplug.core.listeners import Listeners

logger = logging.getLogger("kvplug.events")

EventKind = Literal["stored", "loaded", "evicted", "removed"]


@dataclass(frozen=True)
class KVEvent:
    """Something happened to some chunks in some tier.

    ``keys`` are chunk keys; ``token_counts`` gives the tokens per key when known
    (stored/loaded events from the cache engine), else it is empty.
    """

    kind: EventKind
    keys: tuple[str, ...]
    tier: str | None = None
    token_counts: tuple[int, ...] = ()
    timestamp: float = field(default_factory=time.time)


#: Something that wants to hear of events.
EventListener = Callable[[KVEvent], None]


class EventListeners(Listeners[[KVEvent]]):
    """One cache engine's event fan-out: the process-wide hook, then its own listeners
    (called on the thread that caused the event; one that raises is logged, the others run)."""

    def __init__(self, hook: EventListener) -> None:
        super().__init__(logger, "event listener")
        self._hook = hook

    def emit(self, event: KVEvent) -> None:
        self._hook(event)
        self.call_each(event)
