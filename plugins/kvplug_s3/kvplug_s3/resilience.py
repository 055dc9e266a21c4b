"""Deadlines, bounded retries and a circuit breaker around object operations.

A remote store that is down must cost the serving engine nothing: one failing
batch opens the breaker, and from then on lookups are answered "miss" and puts
are dropped without a network call, until a probe after the cool-down finds the
store back (LMCache's remote backend, by contrast, fails every request while its
server is down).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

from kvplug.errors import TierUnavailableError

T = TypeVar("T")
BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """closed -> open after ``failure_threshold`` consecutive failures -> half_open
    after ``cooldown_s`` (one probe batch may go) -> closed on a success, open again
    on a failure. Thread-safe; ``clock`` is injectable so the state machine can be
    tested without sleeping."""

    def __init__(self, failure_threshold: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state: BreakerState = "closed"
        self._consecutive_failures = 0
        self._opened_at = 0.0
        self._probe_started = 0.0
        self.opens = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """Whether a batch may use the store now. After the cool-down the first
        caller becomes the probe; others are refused until it reports, or until
        another cool-down passes without an answer (a probe that vanished)."""
        with self._lock:
            if self._state == "closed":
                return True
            now = self._clock()
            if self._state == "open":
                if now - self._opened_at < self.cooldown_s:
                    return False
                self._state = "half_open"
                self._probe_started = now
                return True
            if now - self._probe_started >= self.cooldown_s:
                self._probe_started = now
                return True
            return False

    def may_retry(self) -> bool:
        """Whether a failed attempt may be retried: not once the breaker opened."""
        with self._lock:
            return self._state != "open"

    def record_success(self) -> bool:
        """Count a success; ``True`` when this one closed an open breaker."""
        with self._lock:
            self._consecutive_failures = 0
            reopened = self._state != "closed"
            self._state = "closed"
            return reopened

    def record_failure(self) -> bool:
        """Count a failure; ``True`` when this one opened the breaker."""
        with self._lock:
            self._consecutive_failures += 1
            should_open = self._state == "half_open" or (
                self._state == "closed" and self._consecutive_failures >= self.failure_threshold
            )
            if not should_open:
                return False
            self._state = "open"
            self._opened_at = self._clock()
            self.opens += 1
            return True


class Absent(Exception):
    """The object does not exist: an answer, not a failure."""


def is_absent(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError)


def is_permanent(exc: BaseException) -> bool:
    """Failures a retry cannot fix (credentials, a bad request); still failures
    for the breaker, since every later call would fail the same way."""
    return isinstance(exc, (PermissionError, ValueError, TypeError, NotImplementedError))


class RetryPolicy:
    """Runs one object operation with a deadline per attempt, bounded retries
    with exponential backoff and full jitter, and the breaker's bookkeeping."""

    def __init__(
        self,
        breaker: CircuitBreaker,
        *,
        retries: int,
        timeout_s: float,
        backoff_base_s: float,
        backoff_max_s: float,
        on_retry: Callable[[], None] = lambda: None,
        on_open: Callable[[BaseException], None] = lambda exc: None,
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        self.breaker = breaker
        self.retries = retries
        self.timeout_s = timeout_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self._on_retry = on_retry
        self._on_open = on_open
        self._on_close = on_close
        # Jitter only spreads retries out; it needs no cryptographic quality.
        self._random = random.Random()

    def worst_case_s(self) -> float:
        """The longest one operation can take: every attempt timing out."""
        return (self.retries + 1) * self.timeout_s + self.retries * self.backoff_max_s

    async def run(self, operation: Callable[[], Awaitable[T]], *, timeout_s: float | None = None) -> T:
        """The operation's result; raises :class:`Absent` for a missing object and
        :class:`TierUnavailableError` when it failed or the breaker opened.
        ``timeout_s`` replaces the per-attempt deadline (listings take longer)."""
        attempt = 0
        while True:
            try:
                result = await asyncio.wait_for(operation(), timeout_s or self.timeout_s)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - every store error is classified here
                if is_absent(exc):
                    if self.breaker.record_success():
                        self._on_close()
                    raise Absent() from None
                if not isinstance(exc, Exception):
                    raise
                if self.breaker.record_failure():
                    self._on_open(exc)
                if is_permanent(exc) or attempt >= self.retries or not self.breaker.may_retry():
                    raise TierUnavailableError(f"{type(exc).__name__}: {exc}") from exc
                attempt += 1
                self._on_retry()
                ceiling = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1))
                await asyncio.sleep(self._random.uniform(0, ceiling))
                continue
            if self.breaker.record_success():
                self._on_close()
            return result
