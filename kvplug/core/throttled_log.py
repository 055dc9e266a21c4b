"""A warning that can repeat on every request, logged at most once per interval.

Refusals (a pin over a budget, a store with no room beside pinned chunks, a request pin
while request pins are off) can happen on every store of a busy engine; each is counted
in a metric, and this says so in the log without flooding it.
"""

from __future__ import annotations

import logging
import threading
import time

#: Seconds between two lines of one :class:`ThrottledLog`.
DEFAULT_INTERVAL_S = 60.0


class ThrottledLog:
    """Logs the first event at once, then at most one line per ``interval_s`` with the
    number of events since the last line. Thread-safe."""

    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: float | None = None
        self._since = 0

    def warning(self, message: str, *args: object) -> None:
        """Log ``message % args`` (plus how many such events it stands for) if one is due."""
        now = time.monotonic()
        with self._lock:
            self._since += 1
            if self._last is not None and now - self._last < self.interval_s:
                return
            count, self._since, self._last = self._since, 0, now
        self.logger.warning("%s (%d such event(s) since the last line)", message % args if args else message, count)
