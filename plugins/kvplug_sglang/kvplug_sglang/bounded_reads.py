"""Reads of the HiCache backend that wait a bounded time for the tiers.

SGLang's prefetch threads call the backend's ``batch_exists`` and ``batch_get*`` and wait
for them: a prefetch's host memory is released, and the next prefetch starts, only once
the call returns. A remote tier ends its calls within its own deadline, but a tier stuck
in a call (a hung mount, a tier plugin without deadlines) would hold those threads, and
every request waiting on their prefetches, forever. So a read runs on a daemon thread of
its own and the caller waits for it at most ``timeout_s``: past that the read is a miss,
and its late result is dropped (the caller copies pages into SGLang's host pool only
from a read that returned in time, so a late one never writes memory SGLang reused).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("kvplug.sglang.hicache")

T = TypeVar("T")

#: Reads of one backend running at once; past it (reads stuck in a tier) a read is a miss at once.
MAX_READS_IN_FLIGHT = 4


class BoundedReads:
    """Runs reads on daemon threads and waits for each at most ``timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        #: Reads given up (past ``timeout_s``, or no room while earlier reads were stuck).
        self.given_up = 0
        self._room = threading.BoundedSemaphore(MAX_READS_IN_FLIGHT)

    def run(self, read: Callable[[], T], miss: T, what: str) -> T:
        """``read()``'s result, or ``miss`` if it does not return within ``timeout_s``;
        an exception it raises is raised here."""
        if not self._room.acquire(blocking=False):
            return self._give_up(miss, what, "earlier reads are still stuck in a tier")
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                outcome["value"] = read()
            except BaseException as exc:  # handed to the caller, if it still waits
                outcome["error"] = exc
            finally:
                self._room.release()
                done.set()

        try:
            threading.Thread(target=work, name="kvplug-hicache-read", daemon=True).start()
        except RuntimeError as exc:  # no thread to be had (a pids limit): the read never runs
            self._room.release()  # (else its room were lost for good: every read a miss)
            return self._give_up(miss, what, f"no thread could be started for it ({exc})")
        if not done.wait(self.timeout_s):
            return self._give_up(miss, what, f"the tiers did not answer within {self.timeout_s:g} s")
        if "error" in outcome:
            raise outcome["error"]
        value: T = outcome["value"]
        return value

    def _give_up(self, miss: T, what: str, why: str) -> T:
        self.given_up += 1
        logger.warning("kvplug HiCache %s is a miss: %s (%d reads given up)", what, why, self.given_up)
        return miss
