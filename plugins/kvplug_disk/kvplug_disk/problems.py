"""What went wrong in a disk tier's folder, counted and reported without flooding the log.

Two kinds of trouble:

- an *entry* the tier must leave alone: a folder, link or FIFO where a record should
  be, a shard folder replaced by a link, a record file the process may not delete
  (EPERM/EACCES). It is skipped from then on (never a hit, never in the budget),
  logged once, and counted by kind;
- an *error* of an operation (a write on a full disk, a failed fsync): counted, passed
  to the engine's Prometheus counters (``TierContext.count_error``), and logged once
  per burst: at most one warning per ``WARN_INTERVAL_S`` and kind, with the number of
  the ones not logged since.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable

#: Least time between two warnings of one kind of error.
WARN_INTERVAL_S = 60.0

ENTRY_KINDS = ("foreign", "undeletable")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def is_no_space(exc: OSError) -> bool:
    return exc.errno in _NO_SPACE


def is_undeletable(exc: OSError) -> bool:
    """An entry the process may not remove or replace (as opposed to a passing failure)."""
    return exc.errno in (errno.EPERM, errno.EACCES, errno.EISDIR, errno.ENOTEMPTY, errno.EROFS)


class ProblemLog:
    """Entries to skip and counted errors of one disk tier; thread-safe."""

    def __init__(self, logger: logging.Logger, count_error: Callable[[str], None] | None = None) -> None:
        self._logger = logger
        #: The tier's logger (the backend's eviction guard logs refused pins there).
        self.logger = logger
        self._count_error = count_error
        self._lock = threading.Lock()
        self._skipped: dict[str, str] = {}
        self.counts: dict[str, int] = dict.fromkeys((*ENTRY_KINDS, "enospc", "enospc_evictions", "lock_timeouts"), 0)
        self.errors = 0
        self._last_warned: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def skip(self, digest: str, kind: str, detail: object) -> bool:
        """Leave ``digest``'s entry alone from now on; ``True`` the first time (then logged)."""
        with self._lock:
            if digest in self._skipped:
                return False
            self._skipped[digest] = kind
            self.counts[kind] += 1
        self._logger.warning("disk tier: skipping %s (%s): %s", digest, kind, detail)
        return True

    def is_skipped(self, digest: str) -> bool:
        return digest in self._skipped  # a dict read is atomic; a stale answer is as good as a racing one

    def error(self, op: str, what: str, exc: OSError, *, warn: bool = True) -> None:
        """Count a failed operation; warn unless one of its kind was logged recently
        (or ``warn`` is false: someone else reports it)."""
        kind = f"{op}:{errno.errorcode.get(exc.errno or 0, exc.errno)}"
        now = time.monotonic()
        with self._lock:
            self.errors += 1
            if is_no_space(exc):
                self.counts["enospc"] += 1
            elif isinstance(exc, BlockingIOError):  # the folder's lock stayed held past its wait
                self.counts["lock_timeouts"] += 1
            last = self._last_warned.get(kind)
            quiet = not warn or (last is not None and now - last < WARN_INTERVAL_S)
            if not warn:
                pass
            elif quiet:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            else:
                self._last_warned[kind] = now
                suppressed = self._suppressed.pop(kind, 0)
        if self._count_error is not None:
            self._count_error(op)
        if not quiet:
            more = f" ({suppressed} more since the last warning)" if suppressed else ""
            self._logger.warning("disk tier: %s of %s failed: %s%s", op, what, exc, more)
