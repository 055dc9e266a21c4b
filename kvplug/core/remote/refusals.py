"""Writes a store refuses for want of permission, while it still serves reads.

A credential, ACL or bucket policy that allows reading but not writing (S3's ``AccessDenied``
on a PUT, Valkey's ``NOPERM`` on a SET) is a misconfiguration of writes alone: failing the batch would open the tier's circuit
breaker, and every lookup would then miss records the store holds. So a refused write is that
record's failure (dropped and counted, warned about at the tier's rate), and the next writes are
refused here without a request until a cool-down has passed; then one is tried again (the
permission may have been granted since).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class WriteRefusals:
    """The last write refusal, repeated without a request for ``cooldown_s`` seconds."""

    def __init__(self, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._refusal: PermissionError | None = None
        self._until = 0.0

    def current(self) -> PermissionError | None:
        """The refusal to give a write now without sending it, or ``None`` (send it).

        Once the cool-down has passed, one caller gets ``None`` (its write is the one tried
        again) and the cool-down starts over for the others: the writes due at that moment
        (a batch the tier sends at once) are not all sent to be refused. That write's
        success (:meth:`accepted`) lets every write through at once."""
        with self._lock:
            if self._refusal is None:
                return None
            now = self._clock()
            if now < self._until:
                return self._refusal
            self._until = now + self.cooldown_s
            return None

    def accepted(self) -> None:
        """The store took a write: it refuses none now (the permission was granted)."""
        with self._lock:
            self._refusal = None

    def refused(self, where: str, cause: str) -> PermissionError:
        """Note that the store refused a write (``cause``); the error each write gets meanwhile."""
        refusal = PermissionError(
            f"{where} refuses writes ({cause}); reads go on, a write is tried again after {self.cooldown_s:g} s"
        )
        with self._lock:
            self._refusal, self._until = refusal, self._clock() + self.cooldown_s
        return refusal
