"""Events: what happened to KV chunks, and who hears of it.

Each :class:`~kvplug.CacheEngine` hands its events (its stores and loads, its tiers'
evictions and removals) to its own listeners (:meth:`CacheEngine.add_event_listener`),
so two engines in one process never see each other's events, and to the process-wide
``kvplug_on_event`` hook, whose observers see every engine's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

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


class EventListeners:
    """One cache engine's event fan-out: the process-wide hook, then its own listeners.

    A listener is called on the thread that caused the event (often a storage
    worker): it must be quick. One that raises is logged; the others still run.
    """

    def __init__(self, hook: EventListener) -> None:
        self._hook = hook
        # Replaced, never mutated: ``emit`` (on storage threads) reads it without the lock.
        self._listeners: tuple[EventListener, ...] = ()
        self._lock = threading.Lock()

    def add(self, listener: EventListener) -> None:
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def remove(self, listener: EventListener) -> None:
        """Stop calling ``listener``; nothing happens if it was not added."""
        with self._lock:
            listeners = list(self._listeners)
            if listener in listeners:
                listeners.remove(listener)
            self._listeners = tuple(listeners)

    def emit(self, event: KVEvent) -> None:
        self._hook(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                logger.exception("event listener %r failed", listener)
