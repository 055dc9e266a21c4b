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
