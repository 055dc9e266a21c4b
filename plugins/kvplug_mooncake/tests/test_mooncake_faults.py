"""Tier ``mooncake`` when the store fails for real: processes killed, hung (SIGSTOP),
nothing listening, a full segment. Requests keep being answered within their
deadlines, an open breaker costs < 1 ms per lookup, and the tier recovers by itself."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from kvplug import key_digest
from kvplug.core.remote.calls import call_budget
from kvplug.errors import TierUnavailableError
from kvplug.testing import key_for, value_for
from kvplug_mooncake.testing import MooncakeCluster, free_port

#: Quick failure detection, so each test takes seconds, not minutes.
FAST = {
    "request_timeout_s": 0.5,
    "retries": 0,
    "breaker_failures": 2,
    "breaker_cooldown_s": 1.0,
    "setup_timeout_s": 3.0,
}


@pytest.fixture
def cluster(tmp_path):
    """A cluster of its own: these tests kill it."""
    with MooncakeCluster(tmp_path / "cluster") as cluster:
        yield cluster


def _timed(call):
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def _open_breaker(tier, keys):
    """Calls that need the master (a put allocates space there) until the breaker opens;
    each is answered within its deadline. (Lookups may be answered from the client's cache.)"""
    for i in range(6):
        probe = key_for(f"probe{i}")
        _, cost = _timed(lambda: tier.put([(probe, b"probe")]))  # noqa: B023 - called at once
        assert cost < 1.5
        answers, cost = _timed(lambda: tier.contains(keys))
        assert cost < 1.5 and len(answers) == len(keys)
        if tier.stats().extra["breaker_state"] == "open":
            return
    raise AssertionError(f"the breaker did not open: {tier.stats().extra}")


def _assert_short_circuit_costs_under_1ms(tier, keys):
    costs = sorted(_timed(lambda: tier.contains(keys))[1] for _ in range(50))
    assert costs[len(costs) // 2] < 0.001, (
        f"median lookup with the breaker open took {costs[len(costs) // 2] * 1e3:.2f} ms"
    )
    assert tier.get(keys) == [None] * len(keys)
    puts_dropped = tier.stats().extra["dropped_puts"]
    put_costs = sorted(_timed(lambda: tier.put([(keys[0], b"dropped")]))[1] for _ in range(20))
    assert put_costs[len(put_costs) // 2] < 0.01, f"median put with the breaker open took {put_costs[10] * 1e3:.2f} ms"
    assert tier.stats().extra["dropped_puts"] == puts_dropped + 20


def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("condition not reached in time")


def test_killed_cluster_misses_quickly_then_recovers_after_restart(cluster, make_mooncake_tier):
    tier = make_mooncake_tier(cluster, **FAST)
    keys = [key_for(f"kill{i}") for i in range(4)]
    tier.put([(k, value_for(k, 5000)) for k in keys])
    assert tier.contains(keys) == [True] * 4

    cluster.kill()
    for _ in range(3):
        answers, cost = _timed(lambda: tier.contains(keys))
        assert answers == [False] * 4 and cost < 1.5
    _open_breaker(tier, keys)
    _assert_short_circuit_costs_under_1ms(tier, keys)

    cluster.restart()

    def works_again() -> bool:
        tier.put([(keys[0], value_for("again", 3000))])
        got = tier.get([keys[0]])[0]
        return got is not None and bytes(got) == value_for("again", 3000)

    _wait_until(works_again)
    assert tier.stats().extra["breaker_state"] == "closed"


def test_hung_master_costs_one_deadline_then_nothing(cluster, make_mooncake_tier):
    tier = make_mooncake_tier(cluster, **FAST)
    keys = [key_for(f"hung{i}") for i in range(3)]
    tier.put([(k, value_for(k, 2000)) for k in keys])
    cluster.pause()
    try:
        answers, cost = _timed(lambda: tier.contains(keys))
        assert cost < 1.5 and len(answers) == 3  # the client may still answer from its own cache
        with call_budget(0.2):  # a lookup's budget ends the wait earlier still
            _, cost = _timed(lambda: tier.put([(key_for("while-hung"), b"x")]))
        assert cost < 1.5
        _open_breaker(tier, keys)
        _assert_short_circuit_costs_under_1ms(tier, keys)
    finally:
        cluster.resume()
    _wait_until(lambda: tier.contains(keys[:1]) == [True])
    got = tier.get(keys)
    assert [bytes(v) if v is not None else None for v in got] == [value_for(k, 2000) for k in keys]


def test_nothing_listening_opens_the_breaker_and_construction_does_not_hang(make_mooncake_tier, mooncake_cluster):
    dead = f"127.0.0.1:{free_port()}"
    options = {**FAST, "master": dead, "metadata_server": f"http://127.0.0.1:{free_port()}/metadata"}
    from kvplug.testing import tier_context
    from kvplug_mooncake import MooncakeTier

    tier, cost = _timed(lambda: MooncakeTier(MooncakeTier.Config(**options), tier_context()))
    try:
        assert cost < options["setup_timeout_s"] + 1.0
        keys = [key_for("refused")]
        for _ in range(3):
            answers, cost = _timed(lambda: tier.contains(keys))
            assert answers == [False] and cost < 1.5
        assert tier.stats().extra["breaker_state"] == "open"
        _assert_short_circuit_costs_under_1ms(tier, keys)
    finally:
        tier.close()


def test_a_wrong_metadata_server_is_named_not_the_master(make_mooncake_tier, mooncake_cluster, caplog):
    """The master answers, the metadata server's address has nothing listening: the warning
    names the option at fault (9729927: "connecting to 127.0.0.1:PORT", after "mooncake master
    HOST:PORT is failing", which read as the master's fault)."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    port = free_port()
    tier = make_mooncake_tier(**FAST, metadata_server=f"http://127.0.0.1:{port}/metadata")
    keys = [key_for("no-metadata")]
    for _ in range(FAST["breaker_failures"]):
        assert tier.contains(keys) == [False]
    assert tier.stats().extra["breaker_state"] == "open"
    assert f"connecting to the metadata_server 127.0.0.1:{port}" in caplog.text, caplog.text


def test_full_store_drops_puts_and_counts_them(tmp_path, make_mooncake_tier):
    with MooncakeCluster(tmp_path / "small", segment_size="16MB") as small:
        # A generous deadline: this test is about the store's answer, not its speed.
        tier = make_mooncake_tier(small, **{**FAST, "request_timeout_s": 10.0})
        value = value_for("big", 6 * 1024 * 1024)
        for i in range(5):
            tier.put([(key_for(f"full{i}"), value)])
        stats = tier.stats()
        assert stats.extra["dropped_no_space"] >= 1
        assert stats.puts + stats.extra["dropped_puts"] == 5
        # What was stored reads back whole; what was dropped is a miss, never a wrong value.
        for i in range(5):
            got = tier.get([key_for(f"full{i}")])[0]
            assert got is None or bytes(got) == value
        assert stats.extra["breaker_state"] == "closed"  # a full store answers: not a failure


def test_storage_process_killed_reads_miss_and_new_storage_serves(cluster, make_mooncake_tier):
    tier = make_mooncake_tier(cluster, **FAST)
    keys = [key_for(f"st{i}") for i in range(3)]
    tier.put([(k, value_for(k, 4000)) for k in keys])
    assert cluster.storage is not None
    cluster.storage.kill()
    cluster.storage.wait(5)
    got, cost = _timed(lambda: tier.get(keys))
    assert cost < 1.5
    for key, value in zip(keys, got):
        assert value is None or bytes(value) == value_for(key, 4000)
    cluster.start_storage()

    def stores_again() -> bool:
        tier.put([(keys[0], value_for("new", 1000))])
        value = tier.get([keys[0]])[0]
        return value is not None and bytes(value) == value_for("new", 1000)

    _wait_until(stores_again)


def test_corrupt_object_is_a_counted_miss(mooncake_cluster, make_mooncake_tier):
    tier = make_mooncake_tier()
    key, intruder = key_for("victim"), key_for("intruder")
    # Another writer (a raw client) puts a record framed for another key under this key's object name.
    from mooncake.store import MooncakeDistributedStore

    from kvplug import key_digest
    from kvplug.core.records.frame import pack_record

    name = tier.config.key_prefix + key_digest(key).hex()
    other = MooncakeDistributedStore()
    cluster = mooncake_cluster
    assert other.setup("127.0.0.1", cluster.metadata_server, 0, 16 * 1024**2, "tcp", "", cluster.master_address) == 0
    try:
        assert other.upsert(name, pack_record(intruder, b"foreign bytes")) == 0
    finally:
        other.close()
    assert tier.get([key]) == [None]
    assert tier.stats().extra["corrupt"] == 1
    assert tier.contains([key]) == [False]  # removed


#: A per-key error code: neither "no such object" (0, -704) nor "the store is unavailable".
PER_KEY_ERROR = -700


class _FailsOn:
    """The tier's real client, except that the store fails on one object alone (answers
    ``PER_KEY_ERROR`` for it, and leaves it stored): a fault no real cluster produces on
    demand. Every other object goes through the real client."""

    def __init__(self, client: Any, name: str) -> None:
        self.client, self.name = client, name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.client, attribute)

    def _patched(self, names: list[str], codes: Any) -> list[int]:
        return [PER_KEY_ERROR if name == self.name else int(code) for name, code in zip(names, codes)]

    def batch_is_exist(self, names: list[str]) -> list[int]:
        return self._patched(names, self.client.batch_is_exist(names))

    def batch_get_into(self, names: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        return self._patched(names, self.client.batch_get_into(names, addresses, sizes))

    def batch_remove(self, names: list[str], force: bool) -> list[int]:
        others = [name for name in names if name != self.name]
        done = dict(zip(others, self.client.batch_remove(others, force))) if others else {}
        return [PER_KEY_ERROR if name == self.name else int(done[name]) for name in names]


def test_a_key_the_store_fails_on_alone_is_no_answer_for_it(make_mooncake_tier):
    """A per-key error code is no answer for that key: a miss that keeps the key indexed,
    a removal that failed (counted, raised after the others were removed and reported);
    the batch is not failed and the breaker is not fed."""
    events: list = []
    tier = make_mooncake_tier()
    tier.context.emit = events.append
    keys = [key_for(f"alone{i}") for i in range(3)]
    tier.put([(k, value_for(k, 3000)) for k in keys])
    backend = tier._backend  # the fault goes between the tier and its real client
    backend._store = _FailsOn(backend._store, tier.config.key_prefix + key_digest(keys[0]).hex())

    assert tier.contains(keys) == [False, True, True]
    got = tier.get(keys)
    assert got[0] is None and [bytes(v) for v in got[1:]] == [value_for(k, 3000) for k in keys[1:]]
    assert tier.stats().items == 3  # nothing known to be gone: still indexed
    with pytest.raises(TierUnavailableError, match="1 of 3 removals"):
        tier.remove(keys)
    assert [(e.kind, e.keys) for e in events] == [("stored", tuple(keys)), ("removed", tuple(keys[1:]))]
    stats = tier.stats()
    assert stats.items == 1 and stats.extra["failed_removes"] == 1 and stats.extra["failed_lookups"] == 2
    assert stats.extra["breaker_state"] == "closed" and stats.extra["failures"] == 0

    backend._store = backend._store.client
    assert bytes(tier.get(keys[:1])[0]) == value_for(keys[0], 3000)  # it was never removed
