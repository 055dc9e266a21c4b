"""The circuit breaker's state machine and the retry policy, on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from kvplug.core.remote.retry import Absent, CircuitBreaker, RetryPolicy
from kvplug.errors import TierUnavailableError


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_only() -> None:
    breaker = CircuitBreaker(3, 10.0, FakeClock())
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # a success in between resets the count
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state == "closed" and breaker.allow()
    assert breaker.record_failure() is True
    assert breaker.state == "open" and breaker.opens == 1
    assert not breaker.allow() and not breaker.may_retry()


def test_half_open_lets_one_probe_through_then_closes_or_reopens() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(1, 10.0, clock)
    breaker.record_failure()
    clock.now += 9.9
    assert not breaker.allow()
    clock.now += 0.2
    assert breaker.allow() and breaker.state == "half_open"
    assert not breaker.allow()  # only the probe goes
    assert breaker.record_failure() is True  # the probe failed: open again, for another cool-down
    assert breaker.state == "open" and breaker.opens == 2
    clock.now += 10.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()


def test_a_probe_that_never_reports_does_not_wedge_the_breaker() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker(1, 5.0, clock)
    breaker.record_failure()
    clock.now += 5.0
    assert breaker.allow()
    clock.now += 5.0
    assert breaker.allow()


def run_policy(outcomes: list, *, retries: int, threshold: int = 100) -> tuple[object, int, CircuitBreaker]:
    """Run an operation that fails/succeeds per ``outcomes``; (result or exception, calls, breaker)."""
    breaker = CircuitBreaker(threshold, 60.0)
    policy = RetryPolicy(breaker, retries=retries, timeout_s=1.0, backoff_base_s=0.001, backoff_max_s=0.002)
    calls = 0

    async def operation():
        nonlocal calls
        outcome = outcomes[calls]
        calls += 1
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome == "hang":
            await asyncio.sleep(30)
        return outcome

    try:
        result: object = asyncio.run(policy.run(operation))
    except Exception as exc:
        result = exc
    return result, calls, breaker


def test_transient_failures_are_retried_within_the_bound() -> None:
    assert run_policy([ConnectionError("x"), TimeoutError(), b"ok"], retries=2)[:2] == (b"ok", 3)
    result, calls, _ = run_policy([ConnectionError("x")] * 5, retries=2)
    assert isinstance(result, TierUnavailableError) and calls == 3


def test_a_hanging_attempt_hits_its_deadline() -> None:
    result, calls, _ = run_policy(["hang", b"late"], retries=1)
    assert (result, calls) == (b"late", 2)


def test_missing_objects_and_permanent_errors_are_not_retried() -> None:
    result, calls, breaker = run_policy([FileNotFoundError("k")], retries=3)
    assert isinstance(result, Absent) and calls == 1 and breaker.state == "closed"
    result, calls, _ = run_policy([PermissionError("denied"), b"ok"], retries=3)
    assert isinstance(result, TierUnavailableError) and calls == 1


def test_retries_stop_once_the_breaker_opens() -> None:
    result, calls, breaker = run_policy([OSError("down")] * 10, retries=5, threshold=2)
    assert isinstance(result, TierUnavailableError) and calls == 2 and breaker.state == "open"


@pytest.mark.parametrize("threshold", [1, 4])
def test_open_counts_transitions_not_failures(threshold: int) -> None:
    breaker = CircuitBreaker(threshold, 60.0)
    for _ in range(10):
        breaker.record_failure()
    assert breaker.opens == 1
