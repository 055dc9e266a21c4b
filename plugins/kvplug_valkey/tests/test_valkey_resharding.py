"""A cluster resharded under the tier: slots holding its records moved to another node, to
the end (``MOVED``) and half-way (a slot's keys on both nodes: ``ASK``); a node added and
one removed. Every read is the stored record or a miss, never an error; no node's breaker
opens for a redirection; every record is found again once the slots have moved; the
client of a node that left the cluster is closed and its breaker forgotten."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import valkey
import valkey_reshard as reshard
from valkey.crc import key_slot
from valkey_helpers import FAST_FAILING, QUICK_BREAKER, fresh_prefix, read_hits, sockets_to

from kvplug import CacheEngine
from kvplug.core.records.frame import key_digest
from kvplug.testing import TierRoundTripContract, key_for, value_for
from kvplug.testing.engine_round_trip import LAYOUT, NUM_BLOCKS, caches
from kvplug_valkey.testing import ValkeyCluster, ValkeyServer

#: Slots of node 0 that get two records each (one is moved half-way, the other stays).
SLOTS = 12


def _node_failures(tier: Any) -> float:
    return sum(
        s.value
        for s in tier.context.metrics.samples()
        if s.name == "kvplug_remote_failures_total" and s.labels["kind"].startswith("node_")
    )


def _calls(cluster: ValkeyCluster, command: str) -> int:
    """Calls of ``command`` (``cluster|slots``: the tier reading the slot map) the cluster's nodes have served."""
    calls = 0
    for node in cluster.nodes:
        for line in node.cli("info", "commandstats").splitlines():
            if line.startswith(f"cmdstat_{command}:"):
                calls += int(line.split("calls=")[1].split(",")[0])
    return calls


def _map_reads(cluster: ValkeyCluster) -> int:
    return _calls(cluster, "cluster|slots")


def test_slots_moved_half_way_and_to_the_end_keep_every_record(tmp_path: Path, tiers) -> None:
    with ValkeyCluster(tmp_path / "cluster") as cluster:
        source, target = cluster.nodes[0], cluster.nodes[1]
        prefix = fresh_prefix()
        tier = tiers(cluster.url, key_prefix=prefix, cluster=True, **QUICK_BREAKER)
        pairs = reshard.keys_by_slot(prefix, reshard.owned_slots(source), "moved", SLOTS, 2)
        keys = [key for pair in pairs.values() for key in pair]
        values = {key: value_for(key, 3000) for key in keys}
        tier.put([(key, values[key]) for key in keys])
        assert all(tier.contains(keys)), tier.stats().extra

        # Half-way: the first key of each slot on the target, the second still on the source
        # (which answers ASK for the first, sent again to the target).
        for slot, (moved, _) in pairs.items():
            reshard.begin(source, target, slot)
            reshard.migrate(source, target, [prefix + key_digest(moved).hex()])
        map_reads = _map_reads(cluster)
        for _ in range(2 * QUICK_BREAKER["breaker_failures"]):  # past where a breaker counting redirections opens
            assert all(read_hits(tier, keys, values)), tier.stats().extra
            assert all(tier.contains(keys))
        assert _map_reads(cluster) == map_reads  # ASK says the map is right: not read again at each batch
        # New records of the slots being moved: the source answers ASK, they land on the target.
        late = [key for (key,) in reshard.keys_by_slot(prefix, set(pairs), "late", 3, 1).values()]
        tier.put([(key, value_for(key, 1000)) for key in late])
        extra = tier.stats().extra
        assert extra["nodes_down"] == 0 and extra["breaker_state"] == "closed", extra
        assert _node_failures(tier) == 0

        for slot in pairs:
            reshard.migrate(source, target, reshard.keys_in(source, slot))
            reshard.finish(cluster.nodes, source, target, slot)
        assert all(read_hits(tier, keys, values)), tier.stats().extra  # told MOVED: sent to the target at once
        assert all(read_hits(tier, keys, values)), tier.stats().extra  # the map read again
        assert all(tier.contains(late)) and tier.stats().extra["dropped_puts"] == 0
        # The tier's index: every record once, none taken for gone or corrupt while it moved.
        stats = tier.stats()
        assert stats.items == len(keys) + len(late), stats
        assert stats.bytes_used == 3000 * len(keys) + 1000 * len(late), stats
        assert stats.extra["index_found_gone"] == 0 and stats.extra["corrupt"] == 0, stats.extra
        extra = tier.stats().extra
        assert extra["nodes_down"] == 0 and extra["breaker_state"] == "closed", extra
        assert _node_failures(tier) == 0


def test_a_hung_node_does_not_open_the_breaker_of_the_node_a_redirection_names(tmp_path: Path, tiers) -> None:
    """While a node hangs, the first round of a batch lasts until the nodes' deadline: the keys
    told ASK (their slot half-way moved) then have no time left for the node the reply names.
    They miss; that node is not counted failing (its breaker opened: all its own keys missed)."""
    with ValkeyCluster(tmp_path / "cluster") as cluster:
        source, hung, target = cluster.nodes
        prefix = fresh_prefix()
        tier = tiers(cluster.url, key_prefix=prefix, cluster=True, **FAST_FAILING)
        pairs = reshard.keys_by_slot(prefix, reshard.owned_slots(source), "asked", 3, 2)
        on_hung = [
            k for pair in reshard.keys_by_slot(prefix, reshard.owned_slots(hung), "hung", 2, 2).values() for k in pair
        ]
        on_target = [
            k
            for pair in reshard.keys_by_slot(prefix, reshard.owned_slots(target), "target", 3, 2).values()
            for k in pair
        ]
        asked = [moved for moved, _ in pairs.values()]
        keys = [*asked, *on_hung, *on_target]
        values = {key: value_for(key, 3000) for key in keys}
        tier.put([(key, values[key]) for key in keys])
        assert all(tier.contains(keys)), tier.stats().extra
        for slot, (moved, _) in pairs.items():
            reshard.begin(source, target, slot)
            reshard.migrate(source, target, [prefix + key_digest(moved).hex()])

        hung.pause()
        try:
            # Batches of the keys told ASK and the hung node's: the target answers none in the first round.
            for _ in range(2 * FAST_FAILING["breaker_failures"]):
                read_hits(tier, [*asked, *on_hung], values)
            assert all(read_hits(tier, on_target, values)), tier.stats().extra  # its breaker closed
            extra = tier.stats().extra
            assert extra["nodes_down"] == 1, extra  # the hung node alone
        finally:
            hung.resume()


def test_readings_of_the_map_open_no_connection(valkey_cluster: ValkeyCluster, tiers) -> None:
    """Slots moved to another node one after another: a reading of the map each time, over the
    tier's client of the node asked, connected already (0c22cde: over valkey-py's node objects,
    new at each reading, each connecting afresh, a TLS handshake and four round trips within the
    reading's share of a deadline). Each connection of the tier names itself (``CLIENT
    SETNAME``): none is named during the moves."""
    cluster = valkey_cluster
    _, second, third = cluster.nodes
    prefix = fresh_prefix()
    by_slot = reshard.keys_by_slot(prefix, reshard.owned_slots(second), "reading", 5, 1)
    values = {key: value_for(key, 500) for (key,) in by_slot.values()}
    keys = list(values)
    tier = tiers(cluster.url, key_prefix=prefix, cluster=True)
    tier.put(list(values.items()))
    try:
        for move, slot in enumerate(by_slot):
            if move == 1:  # (the first: the tier connects to the node the slots go to)
                connected, reads = _calls(cluster, "client|setname"), _map_reads(cluster)
            reshard.move_slots(cluster.nodes, second, third, [slot])
            for _ in range(2):  # told MOVED (sent on at once), then the map read
                assert all(read_hits(tier, keys, values)), tier.stats().extra
        assert _map_reads(cluster) - reads >= 4  # (one a move)
        assert _calls(cluster, "client|setname") == connected
    finally:
        reshard.move_slots(cluster.nodes, third, second, [s for s in by_slot if s in reshard.owned_slots(third)])


def test_a_node_added_then_removed_serves_its_slots_and_leaves_no_client(tmp_path: Path, tiers) -> None:
    with ValkeyCluster(tmp_path / "cluster") as cluster, ValkeyServer(tmp_path / "new", cluster_port=True) as new:
        prefix = fresh_prefix()
        tier = tiers(cluster.url, key_prefix=prefix, cluster=True, **QUICK_BREAKER)
        keys = [key_for(f"churn-{i}") for i in range(48)]
        values = {key: value_for(key, 3000) for key in keys}
        tier.put([(key, values[key]) for key in keys])
        assert all(tier.contains(keys)), tier.stats().extra

        reshard.meet(cluster.nodes, new)
        first = cluster.nodes[0]
        moving = sorted({reshard.slot_of(prefix, key) for key in keys} & reshard.owned_slots(first))
        assert moving
        reshard.move_slots([*cluster.nodes, new], first, new, moving)
        for _ in range(3):
            hits = read_hits(tier, keys, values)
        assert all(hits), tier.stats().extra
        assert tier.stats().extra["nodes"] == 4
        assert sockets_to(new.port) > 0  # the tier read the moved records from the new node

        reshard.move_slots([*cluster.nodes, new], new, first, moving)
        reshard.forget(cluster.nodes, new)
        for _ in range(2):  # the first read may be told MOVED by the node that left, and reads the map again
            hits = read_hits(tier, keys, values)
        assert all(hits), tier.stats().extra
        extra = tier.stats().extra
        assert extra["nodes"] == 3 and extra["nodes_down"] == 0 and extra["breaker_state"] == "closed", extra
        # The departed node's client is closed, its breaker forgotten (while its process still runs).
        assert sockets_to(new.port) == 0
        assert f"127.0.0.1:{new.port}" not in tier._backend._nodes._breakers  # (no public view of them)

        new.stop()
        assert all(read_hits(tier, keys, values))
        assert _node_failures(tier) == 0  # nothing went to the stopped node


class _RoundTrip(TierRoundTripContract):
    """The round-trip contract's engines (tiers ``[cpu, valkey]``), for the tests here."""

    plugins = "cpu,valkey"


_engine = _RoundTrip().engine


def _valkey_extra(engine: CacheEngine) -> dict[str, Any]:
    return next(stats.extra for label, stats in engine.chain.stats() if label.endswith(":valkey"))


def _loaded(entry: dict[str, Any], prompts: list[list[int]], where: list[torch.Tensor], source: list) -> list[int]:
    """Tokens of each prompt a fresh engine (empty cpu tier) loads; each load the KV stored, bit for bit."""
    loaded = []
    with _engine(entry) as reader:
        for tokens, slots in zip(prompts, where):
            reader.lookup(tokens)
            target, into = caches(2), torch.randperm(NUM_BLOCKS * LAYOUT.block_size)[: len(tokens)]
            mask = reader.retrieve(tokens, target, into)
            count = int(mask.sum())
            assert bool(mask[:count].all())  # a prefix
            if count:
                got = TierRoundTripContract.gathered(reader, target, into[:count])
                assert torch.equal(TierRoundTripContract.gathered(reader, source, slots[:count]), got)
            loaded.append(count)
        extra = _valkey_extra(reader)
        assert extra["nodes_down"] == 0 and extra["breaker_state"] == "closed", extra
    return loaded


def test_an_engine_stores_and_loads_while_its_records_slots_move(tmp_path: Path) -> None:
    """Slots holding an engine's records moved from node 0 to node 1: begun on all of them,
    half of them with their keys moved (ASK), then finished (MOVED)."""
    with ValkeyCluster(tmp_path / "cluster") as cluster:
        source, target = cluster.nodes[0], cluster.nodes[1]
        prefix = fresh_prefix()
        entry = {"type": "valkey", "url": cluster.url, "cluster": True, "key_prefix": prefix, "request_timeout_s": 5.0}
        kv = caches(1)
        prompts = [list(range(1000 * p, 1000 * p + 40)) for p in range(1, 9)]
        where = [torch.randperm(NUM_BLOCKS * LAYOUT.block_size)[:40] for _ in prompts]
        with _engine(entry) as writer:
            for tokens, slots in zip(prompts[:4], where):
                assert writer.store(tokens, kv, slots) == 40
            writer.flush()
            assert _loaded(entry, prompts[:4], where, kv) == [40] * 4
            with valkey.Valkey(host="127.0.0.1", port=source.port) as client:
                held = sorted({key_slot(name) for name in client.scan_iter(match=prefix + "*")})
            assert held
            for index, slot in enumerate(held):
                reshard.begin(source, target, slot)
                if index % 2:
                    reshard.migrate(source, target, reshard.keys_in(source, slot))
            assert _loaded(entry, prompts[:4], where, kv) == [40] * 4
            for tokens, slots in zip(prompts[4:], where[4:]):  # stored half-way
                assert writer.store(tokens, kv, slots) == 40
            writer.flush()
            for slot in held:
                reshard.migrate(source, target, reshard.keys_in(source, slot))
                reshard.finish(cluster.nodes, source, target, slot)
            extra = _valkey_extra(writer)
            assert extra["nodes_down"] == 0 and extra["breaker_state"] == "closed", extra
        assert _loaded(entry, prompts, where, kv) == [40] * 8
        assert _valkey_extra(writer)["dropped_puts"] == 0
