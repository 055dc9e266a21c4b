"""A cluster node that dies: keys on the live nodes keep hitting (a breaker per node), the
tier's health says one node is down, and the node's keys come back when it does."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import valkey
import valkey_reshard as reshard
from valkey_helpers import FAST_FAILING, QUICK_BREAKER, fresh_prefix

from kvplug.core.records.frame import key_digest
from kvplug.errors import TierUnavailableError
from kvplug.testing import key_for, value_for
from kvplug_valkey.fault_proxy import FaultProxy
from kvplug_valkey.testing import ValkeyCluster


def _stored(tier, keys: list[str], values: list[bytes]) -> None:
    """Put until every key is stored: the first calls discover the cluster, which a busy
    machine may not finish within FAST_FAILING's deadline."""
    deadline = time.monotonic() + 60
    while True:
        tier.put(list(zip(keys, values)))
        if all(tier.contains(keys)):
            return
        assert time.monotonic() < deadline, tier.stats().extra
        time.sleep(0.2)


def _hits_become(tier, keys: list[str], wanted: list[bool]) -> None:
    """Get until the keys that hit are ``wanted``: the first batch after a listing failed reads
    the map again, which a busy machine may not finish within FAST_FAILING's deadline."""
    deadline = time.monotonic() + 60
    while [value is not None for value in tier.get(keys)] != wanted:
        assert time.monotonic() < deadline, tier.stats().extra
        time.sleep(0.2)


def _node_of(cluster: ValkeyCluster, prefix: str, keys: list[str]) -> list[int]:
    """Which node (index into ``cluster.nodes``) holds each key's record."""
    where: dict[bytes, int] = {}
    for index, port in enumerate(cluster.ports):
        with valkey.Valkey(host="127.0.0.1", port=port) as client:
            for name in client.scan_iter(match=prefix + "*"):
                where[name] = index
    return [where[(prefix + key_digest(key).hex()).encode()] for key in keys]


def _node_calls_failed(tier: Any) -> float:
    """Calls of cluster nodes that failed, or that a node's open breaker answered (the tier's metrics)."""
    metrics = tier.context.metrics
    failed = sum(
        s.value
        for s in metrics.samples()
        if s.name == "kvplug_remote_failures_total" and s.labels["kind"].startswith("node_")
    )
    return failed + metrics.value("kvplug_remote_short_circuits_total", tier="0:valkey")


def _stored_on_every_node(
    cluster: ValkeyCluster, tiers: Any, stem: str, options: dict[str, Any] = FAST_FAILING
) -> tuple[Any, list[str], list[bytes], list[int]]:
    """A cluster tier (fast-failing unless ``options``) holding 48 keys named ``stem``: (tier, keys, values, the node of each)."""
    prefix = fresh_prefix()
    tier = tiers(cluster.url, key_prefix=prefix, cluster=True, **options)
    keys = [key_for(f"{stem}-{i}") for i in range(48)]
    values = [value_for(key, 3000) for key in keys]
    _stored(tier, keys, values)
    return tier, keys, values, _node_of(cluster, prefix, keys)


def _each_batch_misses_only_its_keys_while_hung(
    cluster: ValkeyCluster, hung: int, tier, keys: list[str], nodes: list[int], then: Any = lambda: None
) -> None:
    """Node ``hung`` paused (SIGSTOP) for as many batches as open its breaker: each batch
    misses that node's keys alone, and the node is counted down; ``then()``; then it is resumed."""
    alive = [node != hung for node in nodes]
    cluster.nodes[hung].pause()
    try:
        for _ in range(2 * FAST_FAILING["breaker_failures"]):
            got = tier.get(keys)
            assert [value is not None for value in got] == alive, tier.stats().extra
        assert tier.stats().extra["nodes_down"] == 1
        then()
    finally:
        cluster.nodes[hung].resume()


@pytest.mark.parametrize("dead", [0, 2], ids=["the-url-node", "another-node"])
def test_a_dead_node_misses_its_keys_alone(dead: int, tmp_path: Path, tiers) -> None:
    with ValkeyCluster(tmp_path / "cluster") as cluster:
        # (A dead node refuses at once: no deadline is needed to find it, and a loaded machine
        # must not miss the live nodes' keys for a deadline of FAST_FAILING's.)
        tier, keys, values, nodes = _stored_on_every_node(cluster, tiers, "node", QUICK_BREAKER)
        assert set(nodes) == {0, 1, 2}, nodes
        cluster.nodes[dead].kill()

        alive = [node != dead for node in nodes]
        for _ in range(2 * FAST_FAILING["breaker_failures"]):  # past where one breaker for all opened
            got = tier.get(keys)
            assert [value is not None for value in got] == alive, tier.stats().extra
            assert all(bytes(v) == want for v, want, up in zip(got, values, alive) if up and v is not None)
            assert tier.contains(keys) == alive
        extra = tier.stats().extra
        assert extra["breaker_state"] == "closed", extra  # the tier as a whole still serves
        assert extra["nodes_down"] == 1 and extra["nodes"] == 3, extra
        # The engine's metrics say so too: the tier's breaker gauge closed, the node's failures
        # and the calls its open breaker answered counted under the tier's label.
        samples = tier.context.metrics.samples()
        assert tier.context.metrics.value("kvplug_remote_breaker_state", tier="0:valkey") == 0
        node_failures = [
            s.value
            for s in samples
            if s.name == "kvplug_remote_failures_total" and s.labels["kind"].startswith("node_")
        ]
        assert sum(node_failures) >= FAST_FAILING["breaker_failures"], samples
        assert tier.context.metrics.value("kvplug_remote_short_circuits_total", tier="0:valkey") > 0

        # A listing fails on the dead node (valkey-py's client then reads its map again, and
        # read COMMAND from the first primary, node 0, failing while it was down): the live
        # nodes' keys still hit, as they do for a tier made while the node is dead.
        with pytest.raises(TierUnavailableError):
            list(tier.records())
        _hits_become(tier, keys, alive)
        late = tiers(cluster.nodes[1].url, key_prefix=tier.config.key_prefix, cluster=True)
        assert [value is not None for value in late.get(keys)] == alive, late.stats().extra

        # Writes to live nodes land; those to the dead node are dropped, counted.
        more = [key_for(f"more-{i}") for i in range(24)]
        dropped = tier.stats().extra["dropped_puts"]
        tier.put([(key, value_for(key, 1000)) for key in more])
        landed = tier.contains(more)
        assert any(landed) and not all(landed)
        assert tier.stats().extra["dropped_puts"] - dropped == landed.count(False)

        cluster.nodes[dead].start()
        cluster.wait_ok()
        deadline = time.monotonic() + 60
        while True:  # the node's breaker lets a probe through after its cooldown
            tier.put(list(zip(keys, values)))
            if all(tier.contains(keys)):
                break
            assert time.monotonic() < deadline, tier.stats().extra
            time.sleep(0.2)
        assert [bytes(v) for v in tier.get(keys)] == values
        assert tier.stats().extra["nodes_down"] == 0


def test_a_hung_node_costs_its_keys_alone_and_its_connections_are_not_reused_mid_reply(tmp_path: Path, tiers) -> None:
    """A node that accepts and never answers (SIGSTOP): its share of each batch ends at its
    part of the deadline, the others still answer; once it resumes, the replies it then
    sends for the abandoned calls are never taken for a later call's. A listing while the
    node's breaker is open fails at once, saying so, not after waiting on the hung node
    (0c22cde: it scanned it, and failed on its timeout)."""

    def list_while_open() -> None:
        short_circuits = tier.context.metrics.value("kvplug_remote_short_circuits_total", tier="0:valkey")
        with pytest.raises(TierUnavailableError, match="circuit breaker open"):
            list(tier.records())
        assert tier.context.metrics.value("kvplug_remote_short_circuits_total", tier="0:valkey") > short_circuits

    with ValkeyCluster(tmp_path / "cluster") as cluster:
        tier, keys, values, nodes = _stored_on_every_node(cluster, tiers, "hung")
        _each_batch_misses_only_its_keys_while_hung(cluster, 1, tier, keys, nodes, then=list_while_open)
        deadline = time.monotonic() + 60
        while not all(tier.contains(keys)):
            assert time.monotonic() < deadline, tier.stats().extra
            time.sleep(0.2)
        for _ in range(3):
            assert [None if v is None else bytes(v) for v in tier.get(keys)] == values
        extra = tier.stats().extra
        assert extra["nodes_down"] == 0 and extra["corrupt"] == 0 and extra["breaker_state"] == "closed", extra
        assert len(list(tier.records())) == len(keys)


def test_a_hung_url_node_costs_its_keys_alone_also_in_the_batch_that_reads_the_map(tmp_path: Path, tiers) -> None:
    """Once a node's breaker opens the slot map is read again, from the URL's node first: hung,
    it never answers. The reading has a share of the batch's deadline, the nodes the rest: the
    batch that reads the map still gets the live nodes' keys (it waited for the hung node's
    answer until the deadline, and every batch that came meanwhile waited for it too)."""
    with ValkeyCluster(tmp_path / "cluster") as cluster:
        tier, keys, _, nodes = _stored_on_every_node(cluster, tiers, "hung-url")
        _each_batch_misses_only_its_keys_while_hung(cluster, 0, tier, keys, nodes)


def test_the_first_reading_of_the_map_may_take_the_whole_node_deadline(valkey_cluster: ValkeyCluster, tiers) -> None:
    """The URL node behind a slow link (each chunk held 0.35 s: the first reading, a connection
    and three round trips, takes about 2.1 s of the nodes' 3.2 s): the first batch gets the map
    and hits. With no map yet there is no batch to keep time for (0c22cde: the reading was cut
    at half the nodes' deadline, 1.6 s; every attempt connected again and was cut again: the
    tier never served)."""
    prefix = fresh_prefix()
    keys = [key_for(f"slow-url-{i}") for i in range(12)]
    values = [value_for(key, 500) for key in keys]
    tiers(valkey_cluster.url, key_prefix=prefix, cluster=True).put(list(zip(keys, values)))
    proxy = FaultProxy(valkey_cluster.nodes[0].port, delay_s=0.35)
    try:
        proxy.set_mode("delay")
        slow = tiers(proxy.url, key_prefix=prefix, cluster=True, request_timeout_s=4.0, connect_timeout_s=4.0)
        assert [None if v is None else bytes(v) for v in slow.get(keys)] == values, slow.stats().extra
    finally:
        proxy.close()


def test_a_cluster_with_no_node_answering_opens_the_tiers_breaker_and_recovers(tmp_path: Path, tiers) -> None:
    """Every node killed: as for a standalone server, the tier's breaker opens (lookups then
    cost no network call); restarted, the cluster serves again without a new tier. Also after
    a listing ran into every node down (valkey-py dropped each node whose SCAN failed from
    those it reads the slot map from: none left, the tier never served again)."""
    with ValkeyCluster(tmp_path / "cluster") as cluster:
        tier = tiers(cluster.url, cluster=True, **FAST_FAILING)
        keys = [key_for(f"all-{i}") for i in range(24)]
        values = [value_for(key, 2000) for key in keys]
        _stored(tier, keys, values)
        cluster.kill()
        for _ in range(2 * FAST_FAILING["breaker_failures"]):
            assert tier.get(keys) == [None] * len(keys)
        extra = tier.stats().extra
        assert extra["breaker_state"] == "open" and extra["nodes_down"] == 3, extra
        cluster.start()
        _stored(tier, keys, values)
        assert [bytes(v) for v in tier.get(keys)] == values
        assert tier.stats().extra["breaker_state"] == "closed"

        cluster.kill()
        with pytest.raises(TierUnavailableError):
            list(tier.records())
        cluster.start()
        _stored(tier, keys, values)
        assert [bytes(v) for v in tier.get(keys)] == values


def test_a_removal_of_values_read_skips_a_dead_nodes_keys_alone(tmp_path: Path, tiers) -> None:
    """remove_if_same (a load's removal of values it found unusable) of keys on a dead node and
    on live ones: the live nodes' keys are removed, whatever comes of the dead node's (no
    answer for them) (6834e34: the dead node's first key raised RecordUnreadableError, and
    nothing was removed)."""
    with ValkeyCluster(tmp_path / "cluster") as cluster:
        tier, keys, values, nodes = _stored_on_every_node(cluster, tiers, "unusable")
        cluster.nodes[0].kill()
        # The dead node's keys first: each is read again before its removal.
        order = sorted(range(len(keys)), key=lambda i: nodes[i] != 0)
        tier.remove_if_same([(keys[i], values[i]) for i in order])
        live = [key for key, node in zip(keys, nodes) if node != 0]
        assert len(live) < len(keys)
        assert tier.contains(live) == [False] * len(live)


def test_every_operation_of_a_tier_made_while_the_first_primary_is_down(valkey_cluster: ValkeyCluster, tiers) -> None:
    """The cluster client made while the first primary (slot 0's, which valkey-py's own client
    reads ``COMMAND`` from, to route commands) is down: every operation the tier performs serves
    the other nodes' keys (put, contains, get, verify's read, the compare-and-delete, removal);
    the listing fails while a node is down, and lists every record once it is back."""
    cluster = valkey_cluster
    first, second, third = cluster.nodes
    assert 0 in reshard.owned_slots(first)
    prefix = fresh_prefix()
    (down,) = [key for (key,) in reshard.keys_by_slot(prefix, reshard.owned_slots(first), "down", 1, 1).values()]
    others = reshard.owned_slots(second) | reshard.owned_slots(third)
    live = [key for (key,) in reshard.keys_by_slot(prefix, others, "live", 4, 1).values()]
    first.kill()
    try:
        tier = tiers(second.url, key_prefix=prefix, cluster=True, **QUICK_BREAKER)
        tier.put([(key, value_for(key, 1000)) for key in [*live, down]])
        assert tier.contains([*live, down]) == [True] * 4 + [False], tier.stats().extra
        got = tier.get([*live, down])
        assert [None if v is None else bytes(v) for v in got] == [value_for(key, 1000) for key in live] + [None]
        digests = [key_digest(key).hex() for key in live]
        seen = tier.read_record(digests[0])
        assert seen is not None and tier.delete_record_if_same(digests[0], seen) is True
        assert tier.delete_record(digests[1]) is True
        assert tier.contains(live) == [False, False, True, True]
        counted = _node_calls_failed(tier)
        with pytest.raises(TierUnavailableError):
            list(tier.records())
        assert _node_calls_failed(tier) > counted  # (the listing's call of the down node: as a batch's)
    finally:
        first.start()
        cluster.wait_ok()
    assert sorted(record.digest for record in tier.records()) == sorted(digests[2:])
    assert tier.stats().extra["breaker_state"] == "closed"
