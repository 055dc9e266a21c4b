"""When a circuit breaker's opening is worth a warning.

A store that stays down opens its breaker again after every cool-down (the half-open probe
fails): a wrong credential does, for as long as the engine runs. Saying each opening would
repeat one line every few seconds, for good. :class:`OpeningWarnings` says a cause once per
:data:`REOPENING_WARNING_S`, and again once the store answered in between.
"""

from __future__ import annotations

import math
import re
import threading
import time

#: A breaker that opens again for a cause already said (its shape) is said once per this many seconds.
REOPENING_WARNING_S = 600.0
#: What varies between openings for one cause: an address (``valkey-1:6380``, ``10.0.0.7``,
#: ``[::1]:7001``), a fraction (a duration), a number or hex id of 4 digits or more (a port, a
#: request id, a size). Not a number of up to 3 digits: a status code or an errno names the
#: cause (an HTTP 403 and a 503 from one address are two causes; masked, the 403 went unsaid).
_VARYING = re.compile(
    r"\[[0-9a-fA-F:.]*\](?::\d+)?"
    r"|[\w.-]*\w(?::\d+)+\b"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}\b"
    r"|\b\d+\.\d+\b"
    r"|\b(?=[0-9a-fA-F]*[0-9])[0-9a-fA-F]{4,}\b"
)
#: Causes remembered at most (causes that differ in more than numbers; then all are forgotten).
_MAX_CAUSES = 64


def cause_shape(cause: BaseException) -> tuple[str, str]:
    """``cause``'s type and text without what varies between openings for one cause
    (each opening of a cluster that is down may name another node's port)."""
    return type(cause).__name__, _VARYING.sub("#", str(cause))


class OpeningWarnings:
    """Which openings of one breaker to say (see the module). Thread-safe."""

    def __init__(self, interval_s: float = REOPENING_WARNING_S) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._said: dict[tuple[str, str], float] = {}
        self._unsaid = 0

    def due(self, cause: BaseException) -> int | None:
        """``None`` if this opening for ``cause`` is not to be said; else how many openings
        were not said since the last line (to say with it)."""
        now = time.monotonic()
        shape = cause_shape(cause)
        with self._lock:
            if now - self._said.get(shape, -math.inf) < self.interval_s:
                self._unsaid += 1
                return None
            unsaid, self._unsaid = self._unsaid, 0
            if len(self._said) >= _MAX_CAUSES:
                self._said.clear()
            self._said[shape] = now
            return unsaid

    def forget(self) -> None:
        """The store answered: each cause is said again at its next opening."""
        with self._lock:
            self._said, self._unsaid = {}, 0
