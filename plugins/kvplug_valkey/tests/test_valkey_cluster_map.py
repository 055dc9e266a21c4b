"""The edges of the tier's slot map on a real cluster resharded under it: a redirection to a
node the map does not know yet (or to an address no map names), a map read while the URL's
node hangs or after it was reset (an empty map), and the client of a node the map dropped
while a call to it was still on its way."""

from __future__ import annotations

import contextlib
import socketserver
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import valkey_reshard as reshard
from valkey_helpers import FAST_FAILING, fresh_prefix, read_hits, sockets_to

from kvplug.core.records.frame import key_digest
from kvplug.testing import value_for
from kvplug_valkey.fault_proxy import FaultProxy
from kvplug_valkey.testing import ValkeyCluster, ValkeyServer


def _key_in(prefix: str, slots: set[int], stem: str, count: int = 1) -> list[str]:
    """``count`` record keys, each of its own slot among ``slots``."""
    return [key for (key,) in reshard.keys_by_slot(prefix, slots, stem, count, 1).values()]


def _same_slot(prefix: str, slots: set[int], stem: str) -> list[str]:
    """Two record keys of one slot among ``slots``."""
    (pair,) = reshard.keys_by_slot(prefix, slots, stem, 1, 2).values()
    return pair


def _map_reads(nodes: list[ValkeyServer]) -> int:
    """``CLUSTER SLOTS`` calls ``nodes`` have served (a reading of the slot map: valkey-py's)."""
    calls = 0
    for node in nodes:
        for line in node.cli("info", "commandstats").splitlines():
            if line.startswith("cmdstat_cluster|slots:"):
                calls += int(line.split("calls=")[1].split(",")[0])
    return calls


def _requests_waiting_at(port: int) -> int:
    """Bytes sent to the server listening on ``port`` that it has not read (Linux /proc):
    a call on its way to a paused server."""
    waiting = 0
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port:
            waiting += int(fields[4].split(":")[1], 16)
    return waiting


def _until(predicate: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_key_told_ask_for_a_node_that_just_joined_is_read_there_in_the_same_batch(
    valkey_cluster: ValkeyCluster, tmp_path: Path, tiers
) -> None:
    """The first slot moving to a node that just joined, half-way: a key moved already is told
    ASK for a node that serves no slot, which the map (``CLUSTER SLOTS``) does not list. The
    batch reads the map once (``CLUSTER SHARDS`` lists every node) and reads the key there;
    the next batches need no reading, and a listing lists the key there too; moved to the end
    (``MOVED``), the key is read there too."""
    cluster = valkey_cluster
    with ValkeyServer(tmp_path / "new", cluster_port=True) as new:
        first, everyone = cluster.nodes[0], [*cluster.nodes, new]
        prefix = fresh_prefix()
        tier = tiers(cluster.url, key_prefix=prefix, cluster=True)
        moved, _ = keys = _same_slot(prefix, reshard.owned_slots(first), "joined")
        values = {key: value_for(key, 2000) for key in keys}
        tier.put(list(values.items()))
        assert tier.contains(keys) == [True, True]
        reshard.meet(cluster.nodes, new)
        slot = reshard.slot_of(prefix, moved)
        try:
            reshard.begin(first, new, slot)
            reshard.migrate(first, new, [prefix + key_digest(moved).hex()])
            before = _map_reads(everyone)
            assert read_hits(tier, keys, values) == [True, True], tier.stats().extra
            reads = _map_reads(everyone)
            assert reads > before  # that batch read the map
            assert read_hits(tier, keys, values) == [True, True]
            assert _map_reads(everyone) == reads  # the node known: no reading more
            # (0c22cde listed the map's nodes alone: the moved record was not listed)
            assert sorted(r.digest for r in tier.records()) == sorted(key_digest(key).hex() for key in keys)
            reshard.migrate(first, new, reshard.keys_in(first, slot))
            reshard.finish(everyone, first, new, slot)
            assert read_hits(tier, keys, values) == [True, True], tier.stats().extra
        finally:  # the session's cluster as it was, from wherever the test stopped
            if slot not in reshard.owned_slots(new):
                reshard.migrate(first, new, reshard.keys_in(first, slot))
                reshard.finish(everyone, first, new, slot)
            reshard.move_slots(everyone, new, first, [slot])
            reshard.forget(cluster.nodes, new)
        extra = tier.stats().extra
        assert extra["nodes_down"] == 0 and extra["breaker_state"] == "closed", extra


def _announce(node: ValkeyServer, port: int, nodes: list[ValkeyServer]) -> None:
    """Make the cluster name ``node`` at ``port`` (a proxy in front of it) in its map."""
    node.cli("config", "set", "cluster-announce-bus-port", str(node.port + 10000))
    node.cli("config", "set", "cluster-announce-port", str(port))
    for other in nodes:
        _until(lambda o=other: f":{port}@" in o.cli("cluster", "nodes"), f"{other.port} names {node.port} at {port}")


def test_the_map_is_read_past_a_hung_url_node(tmp_path: Path, tiers) -> None:
    """The URL's node hung (a proxy in front of it that never answers, the cluster itself
    healthy): slots move to a node that just joined, which only a new reading of the map
    makes known. The other nodes are asked for it, each within its share of the deadline."""
    with ValkeyCluster(tmp_path / "cluster") as cluster, ValkeyServer(tmp_path / "new", cluster_port=True) as new:
        first, second, _ = cluster.nodes
        proxy = FaultProxy(first.port)
        try:
            _announce(first, proxy.port, cluster.nodes)
            prefix = fresh_prefix()
            tier = tiers(cluster.url, key_prefix=prefix, cluster=True, request_timeout_s=3.0)
            *keys, later = _key_in(prefix, reshard.owned_slots(second), "far", count=4)
            values = {key: value_for(key, 2000) for key in [*keys, later]}
            tier.put(list(values.items()))
            assert all(tier.contains([*keys, later])), tier.stats().extra
            proxy.set_mode("hang")
            reshard.meet(cluster.nodes, new)
            everyone = [*cluster.nodes, new]
            reshard.move_slots(everyone, second, new, [reshard.slot_of(prefix, key) for key in keys])
            for _ in range(3):  # (a busy machine may not answer within one batch's share)
                hits = read_hits(tier, keys, values)
                if all(hits):
                    break
            assert all(hits), tier.stats().extra
            # The node that answered last is asked first: the next reading never waits on the hung one.
            asked = proxy.traffic()[0]
            reads = _map_reads(everyone[1:])
            reshard.move_slots(everyone, second, new, [reshard.slot_of(prefix, later)])
            assert read_hits(tier, [later], values) == [True]  # told MOVED: the map is read again next
            assert read_hits(tier, [later], values) == [True]
            assert _map_reads(everyone[1:]) > reads
            assert proxy.traffic()[0] == asked  # no connection to the hung node
        finally:
            proxy.close()


class _Redirecting(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            while line := self.rfile.readline():  # a RESP array of bulk strings a command
                args = [self.rfile.read(int(self.rfile.readline()[1:]) + 2)[:-2] for _ in range(int(line[1:]))]
                ok = args[0].upper() in (b"CLIENT", b"ASKING")  # (the connection's set-up)
                self.wfile.write(b"+OK\r\n" if ok else b"-MOVED 0 %s\r\n" % self.server.elsewhere)  # type: ignore[attr-defined]


class _Redirector(socketserver.ThreadingTCPServer):
    """A cluster node replaced by a hostile (or broken) server: every command of a key is told
    MOVED to ``elsewhere``, an address that no reading of the cluster's map names."""

    daemon_threads = True

    def __init__(self, elsewhere: str) -> None:
        super().__init__(("127.0.0.1", 0), _Redirecting)
        self.elsewhere = elsewhere.encode()
        self.port = int(self.server_address[1])
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_a_redirection_to_an_address_no_map_names_is_a_miss_and_never_dialled(tmp_path: Path, tiers) -> None:
    """Keys told MOVED to an address that neither ``CLUSTER SLOTS`` nor ``CLUSTER SHARDS`` names:
    each batch reads the map once, the keys miss, and nothing connects to that address."""
    with ValkeyCluster(tmp_path / "cluster") as cluster:
        _, second, third = cluster.nodes
        elsewhere = FaultProxy(second.port)  # (counts the connections it gets)
        redirector = _Redirector(f"127.0.0.1:{elsewhere.port}")
        try:
            _announce(third, redirector.port, cluster.nodes)  # the map names the redirector for it
            prefix = fresh_prefix()
            tier = tiers(cluster.url, key_prefix=prefix, cluster=True)
            (lured,) = _key_in(prefix, reshard.owned_slots(third), "lured")
            (kept,) = _key_in(prefix, reshard.owned_slots(second), "kept")
            values = {key: value_for(key, 1000) for key in (lured, kept)}
            tier.put(list(values.items()))
            for _ in range(2):
                reads = _map_reads(cluster.nodes)
                assert read_hits(tier, [lured, kept], values) == [False, True], tier.stats().extra
                assert elsewhere.traffic() == (0, 0)  # never dialled
                assert _map_reads(cluster.nodes) == reads + 1  # one reading a batch
        finally:
            redirector.shutdown()
            redirector.server_close()
            elsewhere.close()


@pytest.mark.parametrize("retries", [1, 0], ids=["retried", "not-retried"])
def test_a_retry_on_its_way_does_not_reopen_the_client_of_a_node_that_left(
    retries: int, valkey_cluster: ValkeyCluster, tmp_path: Path, tiers
) -> None:
    """A call to a node is on its way (the node paused) when another batch reads the map and the
    node is no longer in it: that batch closes the node's client under the call, whose retry
    must not open a connection again (the client is no longer the tier's: never closed). Not
    retried, its failure is not the node's: the node is not kept among those failing."""
    cluster = valkey_cluster
    with ValkeyServer(tmp_path / "gone", cluster_port=True) as gone:
        first, second, third = cluster.nodes
        prefix = fresh_prefix()
        # (A deadline that the other batches never reach while the call waits on the paused node.)
        options = {**FAST_FAILING, "request_timeout_s": 10.0, "retries": retries}
        tier = tiers(cluster.url, key_prefix=prefix, cluster=True, **options)
        (away,) = _key_in(prefix, reshard.owned_slots(first), "away")  # its slot goes to `gone` and back
        (moved,) = _key_in(prefix, reshard.owned_slots(second), "moved")  # its slot goes to the third node
        values = {key: value_for(key, 1000) for key in (away, moved)}
        tier.put(list(values.items()))
        reshard.meet(cluster.nodes, gone)
        everyone = [*cluster.nodes, gone]
        reshard.move_slots(everyone, first, gone, [reshard.slot_of(prefix, away)])
        _until(lambda: all(read_hits(tier, [away], values)), "the record moved to the new node is read")
        assert sockets_to(gone.port) > 0
        reshard.move_slots(everyone, gone, first, [reshard.slot_of(prefix, away)])
        reshard.forget(cluster.nodes, gone)
        reshard.move_slots(cluster.nodes, second, third, [reshard.slot_of(prefix, moved)])

        with ThreadPoolExecutor(1) as pool:
            gone.pause()
            try:
                # The tier's map still sends `away` to `gone`, which holds the call unanswered.
                on_its_way = pool.submit(read_hits, tier, [away], values)
                _until(lambda: _requests_waiting_at(gone.port) > 0, "the call reached the paused node")
                assert read_hits(tier, [moved], values) == [True]  # told MOVED: the map is read again next
                assert read_hits(tier, [moved], values) == [True]  # the map read: `gone` left it, its client closed
            finally:
                gone.resume()
            on_its_way.result()  # a miss or the record (an error would raise here)
        # No connection to the node that left: its client was closed, and none was opened again.
        assert sockets_to(gone.port) == 0
        nodes = tier._backend._nodes  # (no public view of them)
        assert f"127.0.0.1:{gone.port}" not in nodes._breakers and f"127.0.0.1:{gone.port}" not in nodes._failing


@contextlib.contextmanager
def _reset_node_first(
    cluster: ValkeyCluster, tmp_path: Path, tiers: Any, label: str, **options: Any
) -> Iterator[tuple[ValkeyServer, Any, list[str], dict[str, bytes], int]]:
    """A tier (``options``) whose URL, so the first node its readings ask, is a node that served
    a slot, gave it back, was forgotten, emptied and reset (``CLUSTER RESET``: its ``CLUSTER
    SLOTS`` is empty, and valkey-py's reading of it ends in an ``IndexError``). The tier stored
    three keys of the second node, all in the slot ``moved``, which the test may move to the
    third. Yields ``(reset node, tier, keys, values, moved)``; the session's cluster is put back
    as it was afterwards, from wherever the test stopped."""
    with ValkeyServer(tmp_path / "reset", cluster_port=True) as reset:
        first, second, third = cluster.nodes
        everyone = [*cluster.nodes, reset]
        prefix = fresh_prefix()
        keys = _key_in(prefix, reshard.owned_slots(second), label, count=3)
        moved, lent = reshard.slot_of(prefix, keys[0]), min(reshard.owned_slots(first))
        values = {key: value_for(key, 1000) for key in keys}
        reshard.meet(cluster.nodes, reset)
        joined = True
        try:
            reshard.move_slots(everyone, first, reset, [lent])  # (a node serving no slot is not in the map)
            tier = tiers(reset.url, key_prefix=prefix, cluster=True, **options)
            tier.put(list(values.items()))
            assert all(tier.contains(keys)), tier.stats().extra
            assert tier.stats().extra["nodes"] == 4
            reshard.move_slots(everyone, reset, first, [lent])
            reshard.forget(cluster.nodes, reset)
            joined = False
            reset.cli("flushall")
            reset.cli("cluster", "reset")
            assert reset.cli("cluster", "slots").strip() == ""
            yield reset, tier, keys, values, moved
        finally:
            if joined:
                if lent in reshard.owned_slots(reset):
                    reshard.move_slots(everyone, reset, first, [lent])
                reshard.forget(cluster.nodes, reset)
            if moved in reshard.owned_slots(third):
                reshard.move_slots(cluster.nodes, third, second, [moved])


def test_a_reset_node_asked_first_for_the_map_does_not_stop_the_reading(
    valkey_cluster: ValkeyCluster, tmp_path: Path, tiers
) -> None:
    """A node of the tier's map that gave its slots away, was emptied and reset is the first one
    the next reading asks (the URL's node, the first of the map's nodes). The map is read from
    the next node, and the batches read their records again."""
    cluster = valkey_cluster
    _, second, third = cluster.nodes
    with _reset_node_first(cluster, tmp_path, tiers, "kept") as (reset, tier, keys, values, moved):
        asked = _map_reads([reset])
        reshard.move_slots(cluster.nodes, second, third, [moved])
        for _ in range(3):  # told MOVED (sent on at once), then the map read, then the new map
            assert all(read_hits(tier, keys, values)), tier.stats().extra
        assert _map_reads([reset]) > asked  # the reset node was asked (first), and gave no map
        extra = tier.stats().extra
        assert extra["nodes"] == 3 and extra["nodes_down"] == 0 and extra["breaker_state"] == "closed", extra


def test_a_failed_listing_leaves_no_reading_of_the_map_without_a_deadline(valkey_cluster: ValkeyCluster, tiers) -> None:
    """A listing whose ``SCAN`` of a node fails (the node hung) made valkey-py's cluster client
    read its map again at the next batch, by itself, with no deadline, from the URL's node
    first: hung too, every batch waited on it until its deadline, and the keys of the node that
    answers missed. The tier's own reading is the only one (a share of the deadline per node)."""
    cluster = valkey_cluster
    first, second, third = cluster.nodes
    prefix = fresh_prefix()
    tier = tiers(cluster.url, key_prefix=prefix, cluster=True, **{**FAST_FAILING, "request_timeout_s": 2.0})
    # (Two keys on each node: the second node alone answers.)
    keys = {node.port: _key_in(prefix, reshard.owned_slots(node), str(node.port), count=2) for node in cluster.nodes}
    values = {key: value_for(key, 1000) for node_keys in keys.values() for key in node_keys}
    tier.put(list(values.items()))
    assert all(tier.contains(list(values))), tier.stats().extra
    answering = [key in keys[second.port] for key in values]
    third.pause()
    try:
        with contextlib.suppress(Exception):
            list(tier.records())  # (its SCAN of the third node fails)
        first.pause()
        try:
            for _ in range(2):
                assert read_hits(tier, list(values), values) == answering, tier.stats().extra
        finally:
            first.resume()
    finally:
        third.resume()


def test_a_reading_that_met_a_reset_node_and_no_other_answer_keeps_the_old_map(
    valkey_cluster: ValkeyCluster, tmp_path: Path, tiers
) -> None:
    """The reset node (an empty map) is asked first and no other node answers within its share
    (all paused): valkey-py had replaced the map by the empty one before failing on it, and the
    tier had no map (no node, to its stats, until a batch read the map again). The old map stays: once the nodes answer, the next batch reads its
    records, and the map is read again from the old map's nodes (which valkey-py disconnected)."""
    cluster = valkey_cluster
    _, second, third = cluster.nodes
    with _reset_node_first(cluster, tmp_path, tiers, "old-map", request_timeout_s=2.0) as (
        _,
        tier,
        keys,
        values,
        moved,
    ):
        reshard.move_slots(cluster.nodes, second, third, [moved])
        assert all(read_hits(tier, keys, values))  # told MOVED (sent on): the map is read next
        for node in cluster.nodes:
            node.pause()
        try:
            read_hits(tier, keys, values)  # the reading: the reset node first, then none answers
        finally:
            for node in cluster.nodes:
                node.resume()
        assert tier.stats().extra["nodes"] == 4  # the old map (the reset node's slot in it)
        asked = _map_reads(cluster.nodes)
        assert all(read_hits(tier, keys, values)), tier.stats().extra  # the old map (then MOVED)
        assert all(read_hits(tier, keys, values)), tier.stats().extra  # the map read again
        assert _map_reads(cluster.nodes) > asked
        extra = tier.stats().extra
        assert extra["nodes"] == 3 and extra["breaker_state"] == "closed", extra
