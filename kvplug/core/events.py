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
from collections import deque
from collections.abc import Callable, Sequence
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

    Kinds, and what ``tier`` (the tier's ``name``, e.g. ``cpu``) means for each:

    - ``stored`` with a ``tier``: that tier now holds the keys. Emitted once the write
      landed (an ``async`` tier: from its write queue's thread, after the write), for
      stores, promotions (a hit in a slower tier written to a faster one) and catch-up
      writes alike; never for a write that was dropped, declined by admission, refused
      (over the budget, breaker open) or failed. What routers are told is stored.
    - ``stored`` without a ``tier`` (``None``): the cache engine handed these chunks to its
      tiers (``token_counts`` set); it says nothing of which tier holds them, or whether any does.
    - ``evicted`` / ``removed`` (always with a ``tier``): the keys left that tier (its budget,
      or a removal: ``discard``, a corrupt record found, ``clear``, a reset); a queued write
      cancelled before it landed is not reported (it was never announced ``stored``).
    - ``loaded`` (no ``tier``): the engine loaded the keys into its cache.

    ``tier_index``: the position in its engine's chain (``tiers:``, 0 the fastest) of the tier
    that sent the event, set by the chain on every event its tiers send (a tier builds its
    events with ``tier=self.name`` and leaves it ``None``). ``tier`` is the tier's type and
    says the medium routers are told; two tiers of one type (two ``disk`` folders) differ
    only in ``tier_index``, so a listener that follows which tiers hold a chunk keys them by
    :attr:`tier_id`: one tier's eviction is not the chunk leaving its medium while the
    other still holds it.
    """

    kind: EventKind
    keys: tuple[str, ...]
    tier: str | None = None
    token_counts: tuple[int, ...] = ()
    timestamp: float = field(default_factory=time.time)
    tier_index: int | None = None

    @property
    def tier_id(self) -> tuple[str | None, int | None]:
        """Which tier sent the event, unique in its chain: ``(tier, tier_index)``."""
        return self.tier, self.tier_index


#: Something that wants to hear of events.
EventListener = Callable[[KVEvent], None]


class EventListeners(Listeners[[KVEvent]]):
    """One cache engine's event fan-out: the process-wide hook, then its own listeners
    (called on the thread that caused the event, or, while another thread is delivering
    the same tier's events, on that one, after them: see :class:`OrderedEvents`; one that
    raises is logged, the others run)."""

    def __init__(self, hook: EventListener) -> None:
        super().__init__(logger, "event listener")
        self._hook = hook

    def emit(self, event: KVEvent) -> None:
        self._hook(event)
        self.call_each(event)


#: Events a tier queues at most while another thread delivers its events, before a thread that
#: queues more waits for them to drain (:class:`OrderedEvents`).
MAX_QUEUED_EVENTS = 4096
#: How long a thread waits at most for a tier's queued events to drain: a listener stuck for
#: good must not hang every tier call (its events are left to the thread delivering them).
_DRAIN_WAIT_S = 30.0


class OrderedEvents:
    """One tier's events, delivered in the order its state changed.

    A tier that changes its state under a lock and reports it after letting go of the
    lock (listeners must never run under it: one may call the tier back) would otherwise
    let two threads deliver in the other order: a put's ``stored`` after the ``evicted``
    a racing put caused, and a router then believes a chunk is held that is gone. So the
    tier :meth:`add` s each event while it holds its lock (the queue's order is the order of
    its changes) and calls :meth:`deliver` once it let go of it.

    ``deliver`` sends what is queued on the calling thread; while another thread is
    delivering, it leaves the events to that one, which sends them after its own (in
    order) before it returns. A tier call whose events another thread is still delivering
    (its listener is slow) therefore returns before they were delivered, never blocked,
    while fewer than ``max_queued`` are queued: past that it waits (not under the tier's
    lock, counted in ``waits``) until the queue drained below it, as it would have paid
    the listener's time delivering its own events, so a slow listener never lets the queue
    grow without bound. The delivering thread itself (a listener that calls its tier back)
    never waits; no thread waits for good on a listener stuck for good, and once a wait timed
    out no thread waits again until the delivering thread sent an event since (counted in
    ``waits_skipped``): a listener stuck for good costs one wait, not one per tier call.
    """

    def __init__(self, emit: Callable[[KVEvent], None], *, max_queued: int = MAX_QUEUED_EVENTS) -> None:
        if max_queued < 1:
            raise ValueError(f"OrderedEvents needs max_queued >= 1, got {max_queued}")
        self._emit = emit
        self.max_queued = max_queued
        self._queue: deque[KVEvent] = deque()
        self._delivering = threading.Lock()
        #: The thread delivering (under ``_drained``'s lock), and the threads waiting for the queue to drain.
        self._deliverer: int | None = None
        self._drained = threading.Condition(threading.Lock())
        self._waiting = 0
        #: Times a thread waited for the queue to drain below ``max_queued``.
        self.waits = 0
        #: Times a thread did not wait, past ``max_queued``, since nothing was sent after a wait timed out.
        self.waits_skipped = 0
        #: Events sent (or whose listeners failed) so far: the delivering thread's progress.
        self._sent = 0
        #: ``_sent`` when a wait last timed out: until it moves, the deliverer is taken for stuck.
        self._stalled_at: int | None = None
        #: Keys of the ``stored`` events queued or being sent (counted: two events may name one key).
        self._unsent_stored: dict[str, int] = {}
        self._unsent_lock = threading.Lock()

    def add(self, event: KVEvent) -> None:
        """Queue ``event``; call it under the lock its state change was made under."""
        if event.kind == "stored":
            self._count_stored(event.keys, 1)
        self._queue.append(event)

    def stored_unsent(self, keys: Sequence[str]) -> list[bool]:
        """Whether a ``stored`` of each key is queued or being sent: the tier holds it, and its
        listeners may not have heard it yet (another thread delivers; see the class docstring).
        A write that landed is still on its way to them until then (``writes_in_flight``)."""
        with self._unsent_lock:
            return [key in self._unsent_stored for key in keys]

    def queued(self) -> int:
        """Events queued, not yet delivered."""
        return len(self._queue)

    def deliver(self) -> None:
        """Send the queued events in order, unless another thread is sending them; never
        call it under the tier's lock."""
        while self._queue:
            # Not blocking: a thread that finds another delivering leaves its events to it
            # (also a listener that calls its tier back, on the delivering thread itself).
            if not self._delivering.acquire(blocking=False):
                if not self._wait_for_room():
                    return
                continue
            with self._drained:
                self._deliverer = threading.get_ident()
            try:
                while self._queue:
                    event = self._queue.popleft()
                    try:
                        self._emit(event)
                    finally:  # heard (or its listeners failed): not on its way any more
                        self._sent += 1  # only the delivering thread writes it
                        if event.kind == "stored":
                            self._count_stored(event.keys, -1)
                    if self._waiting:
                        with self._drained:
                            self._drained.notify_all()
            finally:
                with self._drained:
                    self._deliverer = None
                    self._drained.notify_all()
                # Checked again once released: an event queued by a thread that found this
                # one still delivering is sent by the loop's next turn.
                self._delivering.release()

    def _count_stored(self, keys: Sequence[str], step: int) -> None:
        with self._unsent_lock:
            for key in keys:
                left = self._unsent_stored.get(key, 0) + step
                if left > 0:
                    self._unsent_stored[key] = left
                else:
                    self._unsent_stored.pop(key, None)

    def _wait_for_room(self) -> bool:
        """Another thread delivers: wait while the queue is past ``max_queued`` (unless this is
        that thread); whether to try delivering again (it stopped delivering meanwhile)."""
        with self._drained:
            if self._deliverer == threading.get_ident() or len(self._queue) <= self.max_queued:
                return False
            if self._stalled_at == self._sent:  # a wait timed out and nothing was sent since
                self.waits_skipped += 1
                return False
            self.waits += 1
            self._waiting += 1
            try:
                drained = self._drained.wait_for(
                    lambda: len(self._queue) <= self.max_queued or self._deliverer is None, timeout=_DRAIN_WAIT_S
                )
            finally:
                self._waiting -= 1
            if not drained:
                self._stalled_at = self._sent
            return self._deliverer is None
