"""A cluster resharded under the tier: slots holding its records moved to another node, to
the end (``MOVED``) and half-way (a slot's keys on both nodes: ``ASK``); a node added and
one removed. Every read is the stored record or a miss, never an error; no node's breaker
opens for a redirection; every record is found again once the slots have moved; the
client of a node that left the cluster is closed and its breaker forgotten."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import valkey_reshard as reshard
from valkey_helpers import FAST_FAILING, fresh_prefix

from kvplug.core.records.frame import key_digest
from kvplug.testing import key_for, value_for
from kvplug_valkey.testing import ValkeyCluster, ValkeyServer

#: Slots of node 0 that get two records each (one is moved half-way, the other stays).
SLOTS = 12


def _paired_keys(prefix: str, slots: set[int], stem: str, count: int = SLOTS, each: int = 2) -> dict[int, list[str]]:
    """``count`` slots among ``slots``, each with ``each`` record keys."""
    by_slot: dict[int, list[str]] = defaultdict(list)
    pairs: dict[int, list[str]] = {}
    index = 0
    while len(pairs) < count:
        key = key_for(f"{stem}-{index}")
        index += 1
        slot = reshard.slot_of(prefix, key)
        if slot in slots and slot not in pairs:
            by_slot[slot].append(key)
            if len(by_slot[slot]) == each:
                pairs[slot] = by_slot[slot]
    return pairs


def _read(tier: Any, keys: list[str], values: dict[str, bytes]) -> list[bool]:
    """Read ``keys``: each the stored value or a miss (an error would raise here); which hit."""
    got = tier.get(keys)
    for key, value in zip(keys, got):
        assert value is None or bytes(value) == values[key], key
    return [value is not None for value in got]


def _node_failures(tier: Any) -> float:
    return sum(
        s.value
        for s in tier.context.metrics.samples()
        if s.name == "kvplug_remote_failures_total" and s.labels["kind"].startswith("node_")
    )


def test_slots_moved_half_way_and_to_the_end_keep_every_record(tmp_path: Path, tiers) -> None:
    with ValkeyCluster(tmp_path / "cluster") as cluster:
        source, target = cluster.nodes[0], cluster.nodes[1]
        prefix = fresh_prefix()
        tier = tiers(cluster.url, key_prefix=prefix, cluster=True, **FAST_FAILING)
        pairs = _paired_keys(prefix, reshard.owned_slots(source), "moved")
        keys = [key for pair in pairs.values() for key in pair]
        values = {key: value_for(key, 3000) for key in keys}
        tier.put([(key, values[key]) for key in keys])
        assert all(tier.contains(keys)), tier.stats().extra

        # Half-way: the first key of each slot on the target, the second still on the source
        # (which answers ASK for the first: a miss, not an error).
        for slot, (moved, _) in pairs.items():
            reshard.begin(source, target, slot)
            reshard.migrate(source, target, [prefix + key_digest(moved).hex()])
        for _ in range(2 * FAST_FAILING["breaker_failures"]):  # past where a breaker counting redirections opens
            hits = _read(tier, keys, values)
            assert all(hit for hit, key in zip(hits, keys) if key not in {moved for moved, _ in pairs.values()})
            tier.contains(keys)
        # New records of the slots being moved: stored, or dropped and counted, never an error.
        late = [key for (key,) in _paired_keys(prefix, set(pairs), "late", count=3, each=1).values()]
        tier.put([(key, value_for(key, 1000)) for key in late])
        extra = tier.stats().extra
        assert extra["nodes_down"] == 0 and extra["breaker_state"] == "closed", extra
        assert _node_failures(tier) == 0

        for slot in pairs:
            reshard.migrate(source, target, reshard.keys_in(source, slot))
            reshard.finish(cluster.nodes, source, target, slot)
        for _ in range(2):  # the first read may be told MOVED, and reads the map again
            hits = _read(tier, keys, values)
        assert all(hits), tier.stats().extra
        extra = tier.stats().extra
        assert extra["nodes_down"] == 0 and extra["breaker_state"] == "closed", extra
        assert _node_failures(tier) == 0
        landed = tier.contains(late)
        assert tier.stats().extra["dropped_puts"] == landed.count(False), tier.stats().extra


def _sockets_to(port: int) -> int:
    """This process's open TCP sockets whose peer is 127.0.0.1:``port`` (Linux /proc)."""
    ours = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue  # closed since listed
        if link.startswith("socket:["):
            ours.add(link[len("socket:[") : -1])
    count = 0
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == port and fields[9] in ours:
            count += 1
    return count


def test_a_node_added_then_removed_serves_its_slots_and_leaves_no_client(tmp_path: Path, tiers) -> None:
    with ValkeyCluster(tmp_path / "cluster") as cluster, ValkeyServer(tmp_path / "new", cluster_port=True) as new:
        prefix = fresh_prefix()
        tier = tiers(cluster.url, key_prefix=prefix, cluster=True, **FAST_FAILING)
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
            hits = _read(tier, keys, values)
        assert all(hits), tier.stats().extra
        assert tier.stats().extra["nodes"] == 4
        assert _sockets_to(new.port) > 0  # the tier read the moved records from the new node

        reshard.move_slots([*cluster.nodes, new], new, first, moving)
        reshard.forget(cluster.nodes, new)
        for _ in range(2):  # the first read may be told MOVED by the node that left, and reads the map again
            hits = _read(tier, keys, values)
        assert all(hits), tier.stats().extra
        extra = tier.stats().extra
        assert extra["nodes"] == 3 and extra["nodes_down"] == 0 and extra["breaker_state"] == "closed", extra
        # The departed node's client is closed, its breaker forgotten (while its process still runs).
        assert _sockets_to(new.port) == 0
        assert f"127.0.0.1:{new.port}" not in tier._backend._nodes._breakers  # (no public view of them)

        new.stop()
        assert all(_read(tier, keys, values))
        assert _node_failures(tier) == 0  # nothing went to the stopped node
