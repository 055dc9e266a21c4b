"""A store that is down, slow, cutting connections or answering 503: requests
still get answers (misses) within a bound, the breaker opens and stops network
traffic, and the tier recovers by itself when the fault goes away."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvplug.testing import key_for, value_for
from kvplug_s3 import S3Tier

from s3_helpers import BUCKET, FAST_FAILING, FaultProxy, MotoS3, make_s3_tier

#: "Returns instead of hanging": far above the configured deadlines (1 s per attempt).
ANSWER_BOUND_S = 10.0
KEYS = [key_for(f"fault-{i}") for i in range(6)]
VALUES = [value_for(f"fault-{i}", 20_000 + i) for i in range(6)]


@pytest.fixture
def proxy(moto_s3: MotoS3) -> Iterator[FaultProxy]:
    fault_proxy = FaultProxy(moto_s3.port, delay_s=5.0)
    yield fault_proxy
    fault_proxy.close()


def timed(call, *args):
    started = time.monotonic()
    result = call(*args)
    return result, time.monotonic() - started


def wait_for_hits(tier: S3Tier, deadline_s: float = 40.0) -> list:
    """Read until every key hits again (the breaker's probe must get through)."""
    stop = time.monotonic() + deadline_s
    while True:
        got = tier.get(KEYS)
        if all(v is not None for v in got) or time.monotonic() > stop:
            return got
        time.sleep(0.2)


def assert_store_down_behaviour(tier: S3Tier, traffic) -> None:
    """Misses within the bound, breaker open, and no traffic while it is open."""
    for _ in range(3):  # the first call pays the failing attempts; later ones are short-circuited
        got, seconds = timed(tier.get, KEYS)
        assert got == [None] * len(KEYS), tier.stats()
        assert seconds < ANSWER_BOUND_S, tier.stats()
    # The cool-down (3 s) is long against these calls (milliseconds once open).
    before = (traffic(), tier.stats().extra)
    assert before[1]["breaker_state"] == "open" and before[1]["breaker_opens"] >= 1, before[1]
    assert tier.contains(KEYS) == [False] * len(KEYS)
    tier.put([(key_for("during-fault"), b"x" * 100)])
    after = tier.stats().extra
    assert after["dropped_puts"] == before[1]["dropped_puts"] + 1
    assert after["short_circuited"] >= before[1]["short_circuited"] + len(KEYS)
    assert traffic() == before[0], "an open breaker must not touch the network"


def assert_recovers(tier: S3Tier) -> None:
    got = wait_for_hits(tier)
    assert [None if v is None else bytes(v) for v in got] == VALUES, tier.stats()
    assert tier.stats().extra["breaker_state"] == "closed", tier.stats()
    tier.put([(key_for("after-fault"), b"back" * 100)])
    assert bytes(tier.get([key_for("after-fault")])[0]) == b"back" * 100


@pytest.mark.parametrize("fault", ["delay", "cut", "refuse", "http503"])
def test_network_fault_gives_misses_opens_the_breaker_and_recovers(fault: str, proxy: FaultProxy) -> None:
    tier = make_s3_tier(proxy.endpoint, **FAST_FAILING, breaker_cooldown_s=3.0)
    try:
        tier.put(list(zip(KEYS, VALUES)))
        assert [bytes(v) for v in tier.get(KEYS)] == VALUES
        proxy.set_mode(fault)
        assert_store_down_behaviour(tier, lambda: (proxy.connections, proxy.forwarded_bytes))
        proxy.set_mode("pass")
        assert_recovers(tier)
    finally:
        tier.close()


def test_server_stopped_mid_run_then_restarted(moto_s3: MotoS3) -> None:
    # A server of its own, so stopping it does not disturb other tests (moto's
    # objects live in this process and survive the restart).
    server = MotoS3()
    server.start()
    tier = make_s3_tier(server.endpoint, **FAST_FAILING, breaker_cooldown_s=3.0)
    try:
        tier.put(list(zip(KEYS, VALUES)))
        assert tier.contains(KEYS) == [True] * len(KEYS)
        server.stop()
        assert_store_down_behaviour(tier, lambda: 0)
        server.start()
        assert_recovers(tier)
    finally:
        tier.close()
        server.stop()


def test_unreachable_store_at_start_is_not_fatal() -> None:
    """Nothing listens on the endpoint when the tier starts: start-up, flush and
    every request still answer, as misses."""
    from s3_helpers import free_port

    tier = make_s3_tier(f"http://127.0.0.1:{free_port()}", **FAST_FAILING, breaker_cooldown_s=60.0)
    try:
        _, seconds = timed(tier.flush)
        assert seconds < ANSWER_BOUND_S
        for _ in range(4):
            got, seconds = timed(tier.get, KEYS)
            assert got == [None] * len(KEYS) and seconds < ANSWER_BOUND_S
        tier.put([(KEYS[0], VALUES[0])])
        stats = tier.stats()
        assert stats.extra["breaker_state"] == "open"
        assert stats.extra["dropped_puts"] >= 1 and stats.items == 0
    finally:
        tier.close()


def test_a_slow_store_within_the_deadline_still_serves(moto_s3: MotoS3) -> None:
    """Slowness under the deadline is not a failure: values come back whole."""
    proxy = FaultProxy(moto_s3.port, delay_s=0.2)
    tier = make_s3_tier(proxy.endpoint, **{**FAST_FAILING, "read_timeout_s": 3.0, "request_timeout_s": 5.0})
    try:
        tier.put(list(zip(KEYS, VALUES)))
        proxy.set_mode("delay")
        assert [bytes(v) for v in tier.get(KEYS)] == VALUES
        assert tier.stats().extra["breaker_state"] == "closed"
    finally:
        tier.close()
        proxy.close()


def test_bucket_missing_is_a_miss_not_a_crash(moto_s3: MotoS3) -> None:
    tier = make_s3_tier(moto_s3.endpoint, **FAST_FAILING)
    tier_without_bucket = S3Tier(
        S3Tier.Config(**{**tier.config.model_dump(), "url": f"s3://no-such-bucket-{BUCKET}/p"}), tier.context
    )
    try:
        assert tier_without_bucket.get(KEYS[:2]) == [None, None]
        assert tier_without_bucket.contains(KEYS[:2]) == [False, False]
        tier_without_bucket.put([(KEYS[0], VALUES[0])])
        stats = tier_without_bucket.stats()
        assert stats.extra["dropped_puts"] == 1 and stats.puts == 0 and stats.items == 0
    finally:
        tier.close()
        tier_without_bucket.close()
