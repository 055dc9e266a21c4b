"""Which openings of a circuit breaker are logged (kvplug.OpeningWarnings): a store down for
good opens its breaker after every cool-down, and one line per opening would repeat forever."""

from __future__ import annotations

from kvplug import OpeningWarnings


def test_a_cause_said_lately_is_not_said_again_until_the_store_answers() -> None:
    warnings = OpeningWarnings(interval_s=3600)
    assert warnings.due(ConnectionError("Timeout connecting to 127.0.0.1:7001")) == 0
    # The same cause but for its numbers (another node's port), and again: unsaid, counted.
    assert warnings.due(ConnectionError("Timeout connecting to 127.0.0.1:7002")) is None
    assert warnings.due(ConnectionError("Timeout connecting to 127.0.0.1:7001")) is None
    # Another cause is said, with the openings left unsaid before it.
    assert warnings.due(PermissionError("WRONGPASS invalid username-password pair")) == 2
    assert warnings.due(TimeoutError("Timeout connecting to 127.0.0.1:7001")) == 0  # (another type)
    warnings.forget()  # the store answered: each cause is news again
    assert warnings.due(ConnectionError("Timeout connecting to 127.0.0.1:7001")) == 0


def test_a_cause_is_said_again_once_its_interval_passed() -> None:
    warnings = OpeningWarnings(interval_s=0.0)
    assert warnings.due(OSError("down")) == 0
    assert warnings.due(OSError("down")) == 0


def test_causes_that_differ_in_a_status_code_or_errno_are_each_said() -> None:
    warnings = OpeningWarnings(interval_s=3600)
    assert warnings.due(OSError("HTTP 503 from 127.0.0.1:8333")) == 0
    # Every number was masked: the 403 (a credential refused) was taken for the 503 said
    # before, and never said, for as long as the store refused.
    assert warnings.due(OSError("HTTP 403 from 127.0.0.1:8333")) == 0
    assert warnings.due(OSError("Error 113 connecting to valkey-0:6379. No route to host.")) == 0
    assert warnings.due(OSError("Error 111 connecting to valkey-0:6379. No route to host.")) == 0
    # What does vary between openings for one cause is still masked: the address, its port, a
    # request id, a duration.
    assert warnings.due(OSError("HTTP 503 from 10.0.0.7:8334")) is None
    assert warnings.due(OSError("Error 111 connecting to valkey-1:6380. No route to host.")) is None
    assert warnings.due(TimeoutError("request 9f86d081 timed out after 2.51 s")) == 2
    assert warnings.due(TimeoutError("request 4e07408562 timed out after 2.49 s")) is None
