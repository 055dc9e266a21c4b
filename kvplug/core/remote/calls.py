"""Resilience for tiers that talk to a remote store: deadlines, retries, a circuit breaker.

A shared store that is down, slow or hung must cost the serving engine a bounded,
small delay and then nothing. Every remote tier (``s3``, ``valkey``, ``mooncake`` and
third-party ones) runs its store calls through one :class:`RemoteCalls`:

- every attempt has a deadline (``request_timeout_s``), and the caller stops waiting
  at its budget (:func:`call_budget`; the tier chain gives a lookup
  ``lookup_budget_s`` across all its tiers): the answer is then "miss", while the
  operation finishes (or times out, counted) in the background;
- a failed attempt is retried at most ``retries`` times with exponential backoff and
  full jitter, never past the deadline;
- ``breaker_failures`` consecutive failures open a circuit breaker: calls are then
  answered at once, without a network call (lookups miss, stores are dropped and
  counted), until a probe after ``breaker_cooldown_s`` finds the store back;
- breaker state, failures, retries and short-circuited calls are Prometheus metrics.

Calls run on an asyncio loop the tier owns (one thread), so a batch of N keys is N
concurrent requests (or one pipelined request), whatever the client library.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import math
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

from pydantic import Field, PositiveInt

from kvplug.core.config_types import BackoffSeconds, Concurrency, FailureCount, TimeoutSeconds
from kvplug.core.policies.eviction import EvictionName
from kvplug.core.queue_settings import QueueSettings
from kvplug.core.remote.opening_warnings import OpeningWarnings
from kvplug.core.remote.retry import (
    LOOP_STALL_GRACE_S,
    BreakerState,
    CircuitBreaker,
    FailureKind,
    RetryPolicy,
    classify_failure,
)
from kvplug.core.tier import TierConfig, TierContext
from kvplug.errors import TierClosedError, TierUnavailableError

T = TypeVar("T")
A = TypeVar("A")
_STATE_VALUES: dict[BreakerState, float] = {"closed": 0.0, "half_open": 1.0, "open": 2.0}

#: A store that is down fails every put; a tier says so once in this many seconds, not per put.
DROP_WARNING_INTERVAL_S = 60.0
#: How long past its deadline a call may take before the caller stops waiting for a stuck loop.
_BACKSTOP_GRACE_S = LOOP_STALL_GRACE_S

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("kvplug_call_deadline", default=None)


@contextlib.contextmanager
def call_budget(seconds: float | None) -> Iterator[None]:
    """Limit how long every remote call made inside the block (in this thread) is waited for.

    Budgets nest: the tighter one wins. ``None`` adds no limit.
    """
    if seconds is None:
        yield
        return
    deadline = time.monotonic() + seconds
    outer = _deadline.get()
    token = _deadline.set(deadline if outer is None else min(outer, deadline))
    try:
        yield
    finally:
        _deadline.reset(token)


def remaining_budget_s() -> float | None:
    """Seconds left of the innermost :func:`call_budget`, or ``None`` outside one."""
    deadline = _deadline.get()
    return None if deadline is None else deadline - time.monotonic()


class RemoteTierConfig(TierConfig):
    """Options every remote tier shares. Remote tier ``Config`` classes subclass it."""

    queue: QueueSettings = Field(
        default_factory=lambda: QueueSettings(mode="async"),
        description="How the tier chain writes this tier; async by default: from a bounded write queue of "
        "its own, so a slow store never delays a store call (values queued there are readable at once).",
    )
    request_timeout_s: TimeoutSeconds = Field(
        default=2.0, description="Deadline of one attempt of one store operation, transfer included."
    )
    retries: int = Field(default=1, ge=0, le=10, description="Retries after a failed attempt (bounded).")
    backoff_base_s: BackoffSeconds = Field(default=0.02, description="First backoff; doubles per retry, full jitter.")
    backoff_max_s: BackoffSeconds = Field(default=0.5, description="Longest backoff between two attempts.")
    breaker_failures: FailureCount = Field(
        default=3, description="Consecutive failed operations that open the circuit breaker."
    )
    breaker_cooldown_s: TimeoutSeconds = Field(
        default=5.0, description="Seconds the breaker stays open before one probe may try the store."
    )
    max_concurrency: Concurrency = Field(default=32, description="Store operations in flight at once.")


class RecordTierConfig(RemoteTierConfig):
    """Options every record tier has (a :class:`RemoteTierConfig` plus its index)."""

    index_max_keys: PositiveInt = Field(
        default=1_000_000,
        le=100_000_000,
        description="Most records in this process's index of the store (about 300 bytes each), which "
        "gives stats() its figures and max_bytes its eviction order. Past it the next in eviction order are "
        "forgotten, not deleted (warned once); with max_bytes set they are deleted instead, so max_bytes "
        "always holds.",
    )
    scan_on_start: bool = Field(
        default=False,
        description="List the store on start so stats and the max_bytes budget include records already "
        "stored (for stores that can list).",
    )
    eviction: EvictionName = Field(
        default="lru",
        description="Which records max_bytes (and a full index) deletes first: lru (least recently used) "
        "or s3fifo (scan-resistant: a record read at least twice outlives a scan of one-off prompts; "
        "Yang et al., SOSP 2023). Records a start-up listing found go first either way.",
    )


class LoopThread:
    """A daemon thread running one asyncio loop until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            raise TierClosedError("the tier's event loop is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self, final: Coroutine[Any, Any, object] | None = None, timeout_s: float = 5.0) -> None:
        """Cancel what still runs, await ``final`` (closing clients), stop the loop
        and join the thread. Idempotent."""
        if self._closed:
            if final is not None:
                final.close()
            return

        async def shutdown() -> None:
            current = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not current]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if final is not None:
                with contextlib.suppress(Exception):  # a client that fails to close is gone anyway
                    await asyncio.wait_for(final, timeout_s)

        with contextlib.suppress(Exception):  # stop the loop whatever happened
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout_s * 2)
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


class RemoteCalls:
    """How a remote tier calls its store: on its own event loop, under deadlines,
    retries and a circuit breaker, with metrics. See the module docstring.

    A tier builds one in ``__init__`` and uses :meth:`allow` (is the store worth
    asking?), :meth:`run` (one operation) and :meth:`batch` (one operation per key,
    concurrently). Both return or raise within the call's deadline, whatever the
    store does: ``request_timeout_s`` per attempt, bounded retries, and the caller's
    :func:`call_budget`.
    """

    def __init__(
        self,
        tier: str,
        config: RemoteTierConfig,
        context: TierContext,
        *,
        where: str = "",
        classify: Callable[[BaseException], FailureKind] = classify_failure,
    ) -> None:
        self.tier = tier
        self.config = config
        self.context = context
        self.where = where or tier
        self.label = f"{context.tier_index}:{tier}"
        self.loop = LoopThread(f"kvplug-{tier}-{context.tier_index}")
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        #: Totals for the tier's ``stats()`` (the metrics hold the same, per engine).
        self.retried = 0
        self.failed = 0
        self.short_circuited = 0
        metrics = context.metrics
        self._failures = metrics.remote_failures
        self._short_circuits = metrics.remote_short_circuits.labels(self.label)
        self._retries = metrics.remote_retries.labels(self.label)
        self._refused_writes = metrics.remote_refused_writes.labels(self.label)
        #: Records the store refused to write for want of permission (:class:`WriteRefusals`).
        self.refused_writes = 0
        metrics.remote_breaker_state.labels(self.label).set_function(lambda: _STATE_VALUES[self.breaker.state])
        self.policy = RetryPolicy(
            self.breaker,
            retries=config.retries,
            timeout_s=config.request_timeout_s,
            backoff_base_s=config.backoff_base_s,
            backoff_max_s=config.backoff_max_s,
            classify=classify,
            on_retry=self._count_retry,
            on_failure=self._count_failure,
            on_open=self._opened,
            on_close=self._closed_again,
        )
        self._semaphore = asyncio.Semaphore(config.max_concurrency)
        self._drop_warning_lock = threading.Lock()
        self._last_drop_warning: float | None = None
        self._openings = OpeningWarnings()

    # --- calls ----------------------------------------------------------------------

    def allow(self, calls: int = 1) -> bool:
        """Whether the store is worth asking now; ``False`` (counted) while the breaker
        is open or the caller's budget is spent. Costs no network call."""
        remaining = remaining_budget_s()
        if (remaining is None or remaining > 0) and self.breaker.allow():
            return True
        self._count_short_circuit(calls)
        return False

    def run(self, operation: Callable[[], Awaitable[T]], *, timeout_s: float | None = None) -> T:
        """Run one operation on the tier's loop; its result, or :class:`Absent`, or
        :class:`TierUnavailableError` within the deadline."""
        deadline = time.monotonic() + self.policy.worst_case_s(timeout_s)
        future = self.loop.submit(self.policy.run(operation, timeout_s=timeout_s, deadline=deadline))
        return self._wait(future, deadline, remaining_budget_s())

    def batch(self, operation: Callable[[A], Awaitable[T]], arguments: Iterable[A]) -> list[T | BaseException]:
        """Run ``operation`` on each argument concurrently (``max_concurrency`` at a
        time); each result is the value, :class:`Absent`, or the exception that ended
        it. Each argument is submitted as soon as ``arguments`` yields it, so a
        transfer starts while the caller still prepares the next one."""
        budget = remaining_budget_s()
        submitted_at = time.monotonic()

        async def one(argument: A) -> T:
            async with self._semaphore:
                # An operation that waited for a slot while the breaker opened is not
                # sent: queued behind a hung store, it would hold a slot for a whole
                # timeout and delay the probe that finds the store back.
                if not self.breaker.may_retry():
                    self._count_short_circuit(1)
                    raise TierUnavailableError(f"{self.where}: circuit breaker open")
                # Each operation's deadline starts when it gets a slot.
                deadline = time.monotonic() + self.policy.worst_case_s()
                return await self.policy.run(lambda: operation(argument), deadline=deadline)

        futures = [self.loop.submit(one(argument)) for argument in arguments]
        if not futures:
            return []
        # Later waves wait for earlier ones; the backstop allows for them.
        waves = math.ceil(len(futures) / self.config.max_concurrency)
        backstop = time.monotonic() + waves * self.policy.worst_case_s()
        budget_end = None if budget is None else submitted_at + budget
        results: list[T | BaseException] = []
        for future in futures:
            remaining = None if budget_end is None else budget_end - time.monotonic()
            outcome = self._wait_result(future, backstop, remaining)
            results.append(outcome)
        return results

    def dropped(self, cause: BaseException) -> None:
        """A record's write failed (``cause``) and is dropped: a refusal for want of permission
        (a ``PermissionError``, see :class:`~kvplug.WriteRefusals`) is counted apart, and the
        drops are logged once per ``DROP_WARNING_INTERVAL_S``, not once per store (the tier
        counts each drop)."""
        if isinstance(cause, PermissionError):
            self._refused_writes.inc()
            with self._drop_warning_lock:
                self.refused_writes += 1
        now = time.monotonic()
        with self._drop_warning_lock:
            if self._last_drop_warning is not None and now - self._last_drop_warning < DROP_WARNING_INTERVAL_S:
                return
            self._last_drop_warning = now
        self.context.logger.warning("tier %s: puts to %s are failing and dropped (%s)", self.tier, self.where, cause)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine on the tier's loop without waiting (start-up scans)."""
        return self.loop.submit(coro)

    def close(self, final: Coroutine[Any, Any, object] | None = None) -> None:
        """Cancel running calls, await ``final`` (closing the client) and stop the loop."""
        self.loop.close(final=final)

    # --- plumbing -------------------------------------------------------------------

    def _wait(self, future: concurrent.futures.Future[T], deadline: float, budget_s: float | None) -> T:
        # A caller's budget ends the wait, not the operation: it goes on under its own
        # deadline, so a slow first connection still completes (and warms the client)
        # and a hung store still times out and opens the breaker.
        if budget_s is not None and budget_s < deadline - time.monotonic():
            try:
                return future.result(max(budget_s, 0.0))
            except concurrent.futures.TimeoutError:
                raise TierUnavailableError(f"{self.where}: no answer within the caller's budget") from None
            except concurrent.futures.CancelledError:
                raise TierClosedError(f"tier {self.tier!r} ({self.where}) was closed during the call") from None
        # The policy ends every attempt at the deadline; this is the backstop for a
        # loop that is itself stuck (a client library blocking it).
        try:
            return future.result(max(deadline - time.monotonic(), 0.0) + _BACKSTOP_GRACE_S)
        except concurrent.futures.TimeoutError:
            # The loop is stuck (a client blocking it): a failure of the store like any
            # other, or every later call would wait out this backstop too.
            future.cancel()
            stuck = TimeoutError(f"{self.where}: call overran its deadline (the tier's event loop is blocked)")
            self._count_failure(stuck)
            if self.breaker.record_failure():
                self._opened(stuck)
            raise TierUnavailableError(f"{self.where}: call overran its deadline; cancelled") from None
        except concurrent.futures.CancelledError:
            raise TierClosedError(f"tier {self.tier!r} ({self.where}) was closed during the call") from None

    def _wait_result(
        self, future: concurrent.futures.Future[T], deadline: float, budget_s: float | None
    ) -> T | BaseException:
        try:
            return self._wait(future, deadline, budget_s)
        except TierClosedError:
            raise
        except Exception as exc:
            return exc

    def _count_short_circuit(self, calls: int) -> None:
        self.short_circuited += calls
        self._short_circuits.inc(calls)

    def _count_retry(self) -> None:
        self.retried += 1
        self._retries.inc()

    def _count_failure(self, exc: BaseException) -> None:
        self.failed += 1
        kind = "timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
        self._failures.labels(self.label, kind).inc()

    def _opened(self, cause: BaseException) -> None:
        again = self._openings.due(cause)  # (a cause said lately is not said at every cool-down)
        if again is None:
            return
        self.context.logger.warning(
            "tier %s: %s is failing (%s: %s); circuit breaker open for %.1f s: lookups miss, stores are dropped%s",
            self.tier,
            self.where,
            type(cause).__name__,
            cause,
            self.config.breaker_cooldown_s,
            f" (it opened {again} time(s) more, for causes said before, since the last line)" if again else "",
        )

    def _closed_again(self) -> None:
        self._openings.forget()
        self.context.logger.warning("tier %s: %s answers again; circuit breaker closed", self.tier, self.where)
