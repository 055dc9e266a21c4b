"""Scheduler lookups that run off vLLM's scheduler thread (``background_lookups``).

vLLM 0.32 lets ``get_num_new_matched_tokens`` answer ``None``: "ask again next
step", and its scheduler goes on with the other requests. A lookup that needs a
tier whose medium is not memory (disk, remote: a round trip that may take as long
as ``lookup_budget_s``) runs on one of a few threads here; each later ask about
the same request polls it, and the first ask after it is done takes its answer.

Bounds: at most ``max_in_flight`` lookups run at once (a request asked about while
all are busy waits for a free one, asking again each step); a request has its
answer, or "no hit", within ``timeout_s`` of its first ask, whatever its lookup
does; a lookup that raises answers "no hit". An entry lives from a request's first
ask until its answer is taken or the request is discarded (finished or aborted):
a lookup still running then finishes on its thread and its answer is dropped.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvplug import ChunkLocation

logger = logging.getLogger("kvplug.vllm")

#: Where each chunk of the cached prefix is.
Tiers = list[ChunkLocation]


@dataclass(frozen=True)
class Answer:
    """What a background lookup found, and how long the request waited for it."""

    tiers: Tiers
    waited_s: float
    #: Its lookup ran (or waited for a thread) past the timeout: "no hit".
    timed_out: bool = False


@dataclass
class _Entry:
    asked: float
    future: concurrent.futures.Future[Tiers] | None = None


class LookupPool:
    """Background lookups keyed by request id; see the module docstring."""

    def __init__(self, max_in_flight: int, timeout_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self._clock = clock
        self._executor = concurrent.futures.ThreadPoolExecutor(max_in_flight, thread_name_prefix="kvplug-lookup")
        self._entries: dict[str, _Entry] = {}
        self._running = 0
        self._lock = threading.Lock()

    def ask(self, req_id: str, lookup: Callable[[], Tiers]) -> Answer | None:
        """The answer for ``req_id`` if it is ready, else ``None`` (ask again later).

        The first ask starts ``lookup`` on a free thread (or a later ask does, once
        one is free); later calls' ``lookup`` is not used.
        """
        now = self._clock()
        entry = self._entries.setdefault(req_id, _Entry(asked=now))
        if entry.future is None and self._reserve():
            entry.future = self._executor.submit(self._run, lookup)
        if entry.future is not None and entry.future.done():
            del self._entries[req_id]
            return Answer(entry.future.result(), now - entry.asked)
        if now - entry.asked >= self.timeout_s:
            del self._entries[req_id]
            waiting = "running" if entry.future is not None else "waiting for a free lookup thread"
            logger.warning("request %s: lookup still %s after %.1f s: no hit", req_id, waiting, now - entry.asked)
            return Answer([], now - entry.asked, timed_out=True)
        return None

    def discard(self, req_id: str) -> None:
        """Forget ``req_id`` (finished or aborted); a lookup still running ends unseen."""
        self._entries.pop(req_id, None)

    def wait_any(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a running lookup to finish (an idle scheduler need not spin)."""
        futures = [e.future for e in self._entries.values() if e.future is not None and not e.future.done()]
        if futures:
            concurrent.futures.wait(futures, timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    @property
    def in_flight(self) -> int:
        """Lookups running now, those whose request was discarded included."""
        with self._lock:
            return self._running

    def __len__(self) -> int:
        """Requests asked about whose answer is not taken yet."""
        return len(self._entries)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._entries

    def close(self) -> None:
        self._entries.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _reserve(self) -> bool:
        with self._lock:
            if self._running >= self.max_in_flight:
                return False
            self._running += 1
            return True

    def _run(self, lookup: Callable[[], Tiers]) -> Tiers:
        try:
            return lookup()
        except Exception as exc:  # the request computes its prompt; the scheduler never sees the error
            logger.warning("background lookup failed, treated as a miss: %s: %s", type(exc).__name__, exc)
            return []
        finally:
            with self._lock:
                self._running -= 1
