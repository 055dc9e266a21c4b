"""Circuit breaker and retry policy of remote tier calls (used by :mod:`kvplug.core.remote.calls`).

The breaker stops calls to a store that keeps failing and lets one probe through
after a cool-down; the policy runs one operation with a deadline per attempt and
bounded retries with full jitter, judging each failure (:func:`classify_failure`).
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
#: How a failed call is judged: ``absent`` is an answer (no such key), ``permanent``
#: a failure no retry can fix (credentials, missing bucket), ``transient`` worth a retry.
FailureKind = Literal["absent", "permanent", "transient"]


class CircuitBreaker:
    """closed -> open after ``failure_threshold`` consecutive failures -> half_open
    after ``cooldown_s`` (one probe may go) -> closed on a success, open again on a
    failure. Thread-safe; ``clock`` is injectable so the state machine can be tested
    without sleeping."""

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
        """Whether a call may use the store now. After the cool-down the first caller
        becomes the probe; others are refused until it reports, or until another
        cool-down passes without an answer (a probe that vanished)."""
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


#: How far past its deadline an attempt may return before it counts as timed out: only an
#: operation that blocks the event loop gets there (``wait_for`` ends the others).
LOOP_STALL_GRACE_S = 0.1


def _cancelled() -> bool:
    """Whether the running task was asked to cancel (Python 3.11+ can tell)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop: nothing to cancel
        return False
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


class Absent(Exception):
    """The key does not exist in the store: an answer, not a failure.

    A remote operation may raise it itself; :func:`classify_failure` also maps
    ``FileNotFoundError`` to it.
    """


def classify_failure(exc: BaseException) -> FailureKind:
    """The default judgement of an exception raised by a store operation."""
    if isinstance(exc, (Absent, FileNotFoundError)):
        return "absent"
    if isinstance(exc, (PermissionError, ValueError, TypeError, NotImplementedError)):
        return "permanent"
    return "transient"


class RetryPolicy:
    """Runs one store operation with a deadline per attempt, bounded retries with
    exponential backoff and full jitter, and the breaker's bookkeeping."""

    def __init__(
        self,
        breaker: CircuitBreaker,
        *,
        retries: int,
        timeout_s: float,
        backoff_base_s: float,
        backoff_max_s: float,
        classify: Callable[[BaseException], FailureKind] = classify_failure,
        on_retry: Callable[[], None] = lambda: None,
        on_failure: Callable[[BaseException], None] = lambda exc: None,
        on_open: Callable[[BaseException], None] = lambda exc: None,
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        self.breaker = breaker
        self.retries = retries
        self.timeout_s = timeout_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self._classify = classify
        self._on_retry = on_retry
        self._on_failure = on_failure
        self._on_open = on_open
        self._on_close = on_close
        # Jitter only spreads retries out; it needs no cryptographic quality.
        self._random = random.Random()

    def worst_case_s(self, timeout_s: float | None = None) -> float:
        """The longest one operation can take: every attempt timing out."""
        return (self.retries + 1) * (timeout_s or self.timeout_s) + self.retries * self.backoff_max_s

    async def run(
        self, operation: Callable[[], Awaitable[T]], *, timeout_s: float | None = None, deadline: float | None = None
    ) -> T:
        """The operation's result; raises :class:`Absent` for a missing key and
        :class:`TierUnavailableError` when it failed, ran out of time or the breaker
        opened. ``timeout_s`` replaces the per-attempt deadline (listings take longer);
        ``deadline`` (a ``time.monotonic()`` value) ends every attempt and retry."""
        attempt = 0
        while True:
            attempt_s = timeout_s or self.timeout_s
            if deadline is not None:
                attempt_s = min(attempt_s, deadline - time.monotonic())
                if attempt_s <= 0:
                    raise TierUnavailableError("the call's time budget is spent")
            try:
                started = time.monotonic()
                result = await asyncio.wait_for(operation(), attempt_s)
                if _cancelled():  # a result wait_for (before Python 3.12) let through a cancellation
                    raise asyncio.CancelledError
                if time.monotonic() - started > attempt_s + LOOP_STALL_GRACE_S:
                    # wait_for could not end it: the operation blocked the event loop (a
                    # blocking client call in a coroutine). It timed out all the same.
                    raise TimeoutError(f"the operation blocked the event loop past its {attempt_s:g} s deadline")
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                if not isinstance(exc, Exception):
                    raise
                kind = self._classify(exc)
                if kind == "absent":
                    if self.breaker.record_success():
                        self._on_close()
                    raise Absent() from None
                self._on_failure(exc)
                if self.breaker.record_failure():
                    self._on_open(exc)
                out_of_time = deadline is not None and deadline - time.monotonic() <= 0
                if kind == "permanent" or attempt >= self.retries or out_of_time or not self.breaker.may_retry():
                    what = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
                    raise TierUnavailableError(what) from exc
                attempt += 1
                self._on_retry()
                ceiling = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1))
                pause = self._random.uniform(0, ceiling)
                if deadline is not None:
                    pause = min(pause, max(deadline - time.monotonic(), 0.0))
                await asyncio.sleep(pause)
                continue
            if self.breaker.record_success():
                self._on_close()
            return result
