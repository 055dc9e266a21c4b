"""A valkey server that is killed, hung, slow, refusing, behind a wrong password or
full: requests keep being answered within a bound, the breaker opens and then a
lookup costs well under a millisecond with no network traffic, and the tier recovers
by itself when the fault goes away."""

from __future__ import annotations

import logging
import re
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from valkey_helpers import FAST_FAILING

from kvplug.testing import key_for, value_for
from kvplug_valkey import ValkeyTier
from kvplug_valkey.fault_proxy import FaultProxy, SilentListener
from kvplug_valkey.testing import ValkeyCluster, ValkeyServer, free_port

#: "Answers instead of hanging": well above the worst case of FAST_FAILING
#: (2 attempts x 0.3 s + backoff), generous for a loaded 2-core CI machine.
ANSWER_BOUND_S = 2.5
KEYS = [key_for(f"fault-{i}") for i in range(6)]
VALUES = [value_for(f"fault-{i}", 20_000 + i) for i in range(6)]


def timed(call: Callable, *args: object) -> tuple[object, float]:
    started = time.monotonic()
    result = call(*args)
    return result, time.monotonic() - started


def as_bytes(values: list) -> list:
    return [None if v is None else bytes(v) for v in values]


def open_breaker_lookup_cost_s(tier: ValkeyTier) -> float:
    """Median seconds of one contains() while the breaker is open."""
    samples = []
    for _ in range(200):
        _, seconds = timed(tier.contains, KEYS)
        samples.append(seconds)
    return statistics.median(samples)


def assert_down_behaviour(tier: ValkeyTier, traffic: Callable[[], object] | None) -> None:
    """Misses within the bound, breaker open, cheap lookups, stores dropped, no traffic."""
    for _ in range(3):  # the first calls pay the failing attempts; later ones are short-circuited
        got, seconds = timed(tier.get, KEYS)
        assert got == [None] * len(KEYS), tier.stats()
        assert seconds < ANSWER_BOUND_S, (seconds, tier.stats())
    extra = tier.stats().extra
    assert extra["breaker_state"] == "open" and extra["breaker_opens"] >= 1, extra
    before = None if traffic is None else traffic()
    assert tier.contains(KEYS) == [False] * len(KEYS)
    cost = open_breaker_lookup_cost_s(tier)
    assert cost < 0.001, f"a lookup with the breaker open took {cost * 1e3:.3f} ms"
    tier.put([(key_for("during-fault"), b"x" * 100)])
    after = tier.stats().extra
    assert after["dropped_puts"] == extra["dropped_puts"] + 1
    assert after["short_circuited"] >= extra["short_circuited"] + 200 * len(KEYS)
    if traffic is not None:
        assert traffic() == before, "an open breaker must not touch the network"


def wait_for_hits(tier: ValkeyTier, deadline_s: float = 20.0) -> list:
    """Read until every key hits again (the breaker's probe must get through)."""
    stop = time.monotonic() + deadline_s
    while True:
        got = as_bytes(tier.get(KEYS))
        if all(v is not None for v in got) or time.monotonic() > stop:
            return got
        time.sleep(0.1)


def assert_recovers(tier: ValkeyTier, *, store_again: bool = False) -> None:
    if store_again:  # a server restarted without persistence is empty: stores must get through again
        stop = time.monotonic() + 20
        while tier.stats().extra["breaker_state"] != "closed" and time.monotonic() < stop:
            tier.contains(KEYS)
            time.sleep(0.1)
        tier.put(list(zip(KEYS, VALUES)))
    assert wait_for_hits(tier) == VALUES, tier.stats()
    assert tier.stats().extra["breaker_state"] == "closed", tier.stats()


@pytest.fixture
def proxied(own_server: ValkeyServer) -> Iterator[FaultProxy]:
    own_server.start()
    proxy = FaultProxy(own_server.port, delay_s=1.0)
    yield proxy
    proxy.close()


@pytest.mark.parametrize("fault", ["hang", "delay", "refuse"])
def test_network_fault_gives_misses_opens_the_breaker_and_recovers(fault: str, proxied: FaultProxy, tiers) -> None:
    tier = tiers(proxied.url, **FAST_FAILING)
    tier.put(list(zip(KEYS, VALUES)))
    assert as_bytes(tier.get(KEYS)) == VALUES
    proxied.set_mode(fault)
    assert_down_behaviour(tier, proxied.traffic)
    proxied.set_mode("pass")
    assert_recovers(tier)


def test_server_killed_then_restarted(tmp_path: Path, tiers) -> None:
    """SIGKILL mid-run; the server comes back with its data (appendonly, fsync always) and hits return."""
    server = ValkeyServer(tmp_path / "aof", appendonly=True).start()
    try:
        proxy = FaultProxy(server.port)
        try:
            tier = tiers(proxy.url, **FAST_FAILING)
            tier.put(list(zip(KEYS, VALUES)))
            server.kill()
            assert_down_behaviour(tier, proxy.traffic)
            server.start()
            assert_recovers(tier)
        finally:
            proxy.close()
    finally:
        server.kill()


def test_server_paused_sigstop_then_resumed(own_server: ValkeyServer, tiers) -> None:
    """The real server stops answering (SIGSTOP) but keeps its sockets: a hung store."""
    own_server.start()
    tier = tiers(own_server.url, **FAST_FAILING)
    tier.put(list(zip(KEYS, VALUES)))
    own_server.pause()
    assert_down_behaviour(tier, None)
    own_server.resume()
    assert_recovers(tier)


def test_hung_listener_from_the_start(tiers) -> None:
    """A listener that accepts and never answers: the first lookup is bounded, then the breaker holds."""
    listener = SilentListener()
    try:
        tier = tiers(listener.url, **FAST_FAILING)
        assert_down_behaviour(tier, None)
    finally:
        listener.close()


def test_refused_at_start_then_a_server_appears(tmp_path: Path, tiers) -> None:
    port = free_port()
    tier = tiers(f"redis://127.0.0.1:{port}/0", **FAST_FAILING)
    assert_down_behaviour(tier, None)
    server = ValkeyServer(tmp_path / "late", port=port).start()
    try:
        assert_recovers(tier, store_again=True)
    finally:
        server.kill()


def test_wrong_password_opens_the_breaker_without_retries(tmp_path: Path, tiers) -> None:
    server = ValkeyServer(tmp_path / "auth", password="right-secret-1").start()
    try:
        wrong = tiers(server.url, password="wrong-secret-2", **FAST_FAILING)
        assert_down_behaviour(wrong, None)
        assert wrong.stats().extra["retries"] == 0  # a credential error is permanent: never retried
        assert "wrong-secret-2" not in repr(wrong.config) and "wrong-secret-2" not in str(wrong.stats())
        missing = tiers(server.url, **FAST_FAILING)  # no password at all: NOAUTH
        assert missing.get(KEYS) == [None] * len(KEYS)
        right = tiers(server.url, password="right-secret-1", **FAST_FAILING)
        right.put(list(zip(KEYS, VALUES)))
        assert as_bytes(right.get(KEYS)) == VALUES
    finally:
        server.kill()


def test_a_breaker_opening_again_for_the_same_cause_is_said_once_not_per_cool_down(
    tmp_path: Path, tiers, caplog
) -> None:
    """A wrong password opens the breaker again after every cool-down for as long as the engine
    runs: said once, and again once the store answered in between (1ab131a: one warning per
    opening, every cool-down, forever: ``assert 4 == 1``)."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    quick = {**FAST_FAILING, "breaker_cooldown_s": 0.2}
    with ValkeyServer(tmp_path / "auth", password="right-secret-5") as server:
        wrong = tiers(server.url, password="wrong-secret-6", **quick)
        for _ in range(FAST_FAILING["breaker_failures"]):
            assert wrong.get(KEYS) == [None] * len(KEYS)
        opened = wrong._calls.breaker.opens
        while wrong._calls.breaker.opens < opened + 3:  # (each half-open probe fails: opened again)
            time.sleep(quick["breaker_cooldown_s"])
            assert wrong.get(KEYS) == [None] * len(KEYS)
        failing = [r.getMessage() for r in caplog.records if "is failing" in r.getMessage()]
        assert len(failing) == 1 and "AuthenticationError" in failing[0], failing
    caplog.clear()
    with ValkeyServer(tmp_path / "down") as server:  # a store that answers in between: said again
        tier = tiers(server.url, **quick)
        for _ in range(2):
            server.kill()
            for _ in range(FAST_FAILING["breaker_failures"]):
                tier.get(KEYS)
            server.start()
            time.sleep(quick["breaker_cooldown_s"])
            assert tier.get(KEYS) == [None] * len(KEYS)
        assert sum("is failing" in r.getMessage() for r in caplog.records) == 2, caplog.text
        assert sum("answers again" in r.getMessage() for r in caplog.records) == 2, caplog.text


def test_a_cause_naming_another_node_each_opening_is_still_said_once(tmp_path: Path, tiers, caplog) -> None:
    """A whole cluster down opens the breaker again after every cool-down, each time for the
    first node of that batch ("Error 111 connecting to 127.0.0.1:<port>"): one cause, said once
    (eab791a compared the text, port and all: a line per port, the same cause but for its numbers)."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    with ValkeyCluster(tmp_path / "down") as cluster:
        tier = tiers(cluster.url, cluster=True, **{**FAST_FAILING, "breaker_cooldown_s": 0.2})
        assert tier.get(KEYS) == [None] * len(KEYS)  # (the map read while the nodes answer)
        cluster.kill()
        batch = 0
        while tier._calls.breaker.opens < 6:  # (the keys of each batch on another node first)
            batch += 1
            assert tier.get([key_for(f"down-{batch}")]) == [None]
            time.sleep(0.05)
    failing = [r.getMessage() for r in caplog.records if "circuit breaker open for" in r.getMessage()]
    # Each cause once: a batch may also meet a node whose own breaker is open (NodeDownError),
    # another cause, said once too, in either order.
    shapes = [re.sub(r"\d+", "#", line) for line in failing]
    assert len(set(shapes)) == len(shapes) and any("ConnectionError" in line for line in failing), failing


def test_a_cluster_node_down_for_long_is_said_once_not_per_cool_down(tmp_path: Path, tiers, caplog) -> None:
    """One node killed: its breaker opens again after every cool-down (its probe fails) while
    the others serve; said once (eab791a: a line per cool-down, for as long as it is down:
    ``assert len(said) == 1``)."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    keys = [key_for(f"node-down-{i}") for i in range(12)]  # (on every node)
    with ValkeyCluster(tmp_path / "one-down") as cluster:
        tier = tiers(cluster.url, cluster=True, **{**FAST_FAILING, "breaker_cooldown_s": 0.2})
        tier.get(keys)
        down = cluster.nodes[1]
        down.kill()
        breaker = None
        while breaker is None or breaker.opens < 4:  # (each half-open probe fails: opened again)
            tier.get(keys)
            time.sleep(0.05)
            breaker = tier._backend._nodes._breakers.get(f"127.0.0.1:{down.port}")
    said = [
        r.getMessage() for r in caplog.records if f"cluster node 127.0.0.1:{down.port} is failing" in r.getMessage()
    ]
    assert len(said) == 1, said


def test_wrong_password_of_a_cluster_says_so_without_retries(tmp_path: Path, tiers, caplog) -> None:
    """A cluster URL with a wrong (or no) password fails as a server's does: the refusal of the
    credentials named, never retried (0c22cde: "no cluster node gave the map of slots", transient,
    retried); the right one serves every node."""
    with ValkeyCluster(tmp_path / "auth", password="right-secret-3") as cluster:
        caplog.set_level(logging.WARNING, logger="kvplug.tier")
        for password in ("wrong-secret-4", None):
            wrong = tiers(cluster.url, cluster=True, password=password, **FAST_FAILING)
            for _ in range(FAST_FAILING["breaker_failures"]):  # (the tier's breaker opens, saying why)
                assert wrong.get(KEYS) == [None] * len(KEYS)
            assert wrong.stats().extra["retries"] == 0, wrong.stats().extra
            assert "AuthenticationError" in caplog.text and "no cluster node gave" not in caplog.text
            caplog.clear()
        right = tiers(cluster.url, cluster=True, password="right-secret-3", **FAST_FAILING)
        right.put(list(zip(KEYS, VALUES)))
        assert as_bytes(right.get(KEYS)) == VALUES


def test_full_server_drops_stores_counted_and_keeps_serving(tmp_path: Path, tiers) -> None:
    """maxmemory tiny + noeviction: SETs answer OOM. Stores are dropped and counted, the
    breaker stays closed (the server is healthy), and what is stored still hits."""
    server = ValkeyServer(tmp_path / "full", maxmemory="4mb", maxmemory_policy="noeviction").start()
    try:
        tier = tiers(server.url, **FAST_FAILING)
        tier.put(list(zip(KEYS, VALUES)))
        assert as_bytes(tier.get(KEYS)) == VALUES
        filler = [(key_for(f"fill-{i}"), value_for(f"fill-{i}", 512 * 1024)) for i in range(16)]
        for item in filler:
            tier.put([item])
        extra = tier.stats().extra
        assert extra["oom_dropped_puts"] >= 4 and extra["dropped_puts"] >= extra["oom_dropped_puts"], extra
        assert extra["breaker_state"] == "closed" and extra["failures"] == 0, extra
        assert as_bytes(tier.get(KEYS)) == VALUES  # still answering, and right
        stored = tier.contains([key for key, _ in filler])
        assert 0 < sum(stored) < len(filler)
        for (key, value), present in zip(filler, stored):
            got = tier.get([key])[0]
            assert (got is not None) == present and (got is None or bytes(got) == value)
    finally:
        server.kill()


def test_a_slow_server_within_the_deadline_still_serves(own_server: ValkeyServer, tiers) -> None:
    """50 ms added per chunk each way (deadline 1 s): slower, but every answer right and no failure."""
    own_server.start()
    proxy = FaultProxy(own_server.port, delay_s=0.05)
    try:
        tier = tiers(proxy.url, **{**FAST_FAILING, "request_timeout_s": 1.0})
        tier.put(list(zip(KEYS, VALUES)))
        proxy.set_mode("delay")
        got, seconds = timed(tier.get, KEYS)
        assert as_bytes(got) == VALUES and seconds >= 0.1, seconds  # a request and a reply, each delayed
        assert tier.contains(KEYS) == [True] * len(KEYS)
        extra = tier.stats().extra
        assert extra["failures"] == 0 and extra["breaker_state"] == "closed", extra
    finally:
        proxy.close()
