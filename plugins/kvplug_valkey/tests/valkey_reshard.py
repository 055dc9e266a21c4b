"""Resharding a real cluster as valkey-cli does it, one step at a time (so a test can stop
half-way): a slot's keys moved between nodes (``CLUSTER SETSLOT ... IMPORTING/MIGRATING``,
``MIGRATE ... KEYS``, ``SETSLOT ... NODE``), a node joined (``CLUSTER MEET``) or removed
(``CLUSTER FORGET`` on every other node, then stopped)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

import valkey
from valkey.crc import key_slot

from kvplug.core.records.frame import key_digest
from kvplug.testing import key_for
from kvplug_valkey.testing import HOST, ValkeyServer


def slot_of(prefix: str, key: str) -> int:
    """The cluster slot of a tier record's server key (``prefix`` and the key's digest)."""
    return key_slot((prefix + key_digest(key).hex()).encode())


def keys_by_slot(prefix: str, slots: set[int], stem: str, count: int, each: int) -> dict[int, list[str]]:
    """``count`` slots among ``slots``, each with ``each`` record keys (``<stem>-<n>``), in the
    order the slots got their last key."""
    found: dict[int, list[str]] = defaultdict(list)
    chosen: dict[int, list[str]] = {}
    index = 0
    while len(chosen) < count:
        key = key_for(f"{stem}-{index}")
        index += 1
        slot = slot_of(prefix, key)
        if slot in slots and slot not in chosen:
            found[slot].append(key)
            if len(found[slot]) == each:
                chosen[slot] = found[slot]
    return chosen


def _client(node: ValkeyServer) -> valkey.Valkey:
    return valkey.Valkey(host=HOST, port=node.port, socket_timeout=30, decode_responses=True)


def node_id(node: ValkeyServer) -> str:
    with _client(node) as client:
        return str(client.execute_command("CLUSTER", "MYID"))


def owned_slots(node: ValkeyServer) -> set[int]:
    """The slots ``node`` says it serves (its own line of ``CLUSTER NODES``)."""
    text = node.cli("cluster", "nodes")
    for line in text.splitlines():
        fields = line.split()
        if len(fields) > 2 and "myself" in fields[2]:
            slots: set[int] = set()
            for part in fields[8:]:
                if not part.startswith("["):  # (a slot being migrated: listed in its range too)
                    first, _, last = part.partition("-")
                    slots.update(range(int(first), int(last or first) + 1))
            return slots
    raise AssertionError(f"no 'myself' line in CLUSTER NODES of {node.port}: {text!r}")


def begin(source: ValkeyServer, target: ValkeyServer, slot: int) -> None:
    """Mark ``slot`` importing on ``target``, migrating on ``source`` (valkey-cli's order)."""
    with _client(target) as client:
        client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", node_id(source))
    with _client(source) as client:
        client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", node_id(target))


def migrate(source: ValkeyServer, target: ValkeyServer, keys: Sequence[str]) -> None:
    """Move ``keys`` (server keys of a slot being migrated) from ``source`` to ``target``."""
    if keys:
        with _client(source) as client:
            client.execute_command("MIGRATE", HOST, target.port, "", 0, 10000, "KEYS", *keys)


def keys_in(node: ValkeyServer, slot: int) -> list[str]:
    with _client(node) as client:
        return list(client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100000))


def finish(nodes: Sequence[ValkeyServer], source: ValkeyServer, target: ValkeyServer, slot: int) -> None:
    """Give ``slot`` to ``target`` on every node: the target first, then the source, as valkey-cli does."""
    for node in [target, source, *(node for node in nodes if node not in (source, target))]:
        with _client(node) as client:
            try:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", node_id(target))
            except valkey.ResponseError as exc:
                # A master that gave its last slot away becomes a replica of the master that took it.
                if node is target or "only with masters" not in str(exc):
                    raise


def move_slots(nodes: Sequence[ValkeyServer], source: ValkeyServer, target: ValkeyServer, slots: Sequence[int]) -> None:
    """Move ``slots`` with all their keys from ``source`` to ``target``, to the end."""
    for slot in slots:
        begin(source, target, slot)
        migrate(source, target, keys_in(source, slot))
        finish(nodes, source, target, slot)


def meet(nodes: Sequence[ValkeyServer], new: ValkeyServer, timeout_s: float = 30.0) -> None:
    """Join ``new`` (a started cluster-mode server with no slots) to the cluster of ``nodes``."""
    with _client(nodes[0]) as client:
        client.execute_command("CLUSTER", "MEET", HOST, new.port)
    wanted = len(nodes) + 1
    deadline = time.monotonic() + timeout_s
    for node in [*nodes, new]:
        while len(node.cli("cluster", "nodes").splitlines()) < wanted:
            assert time.monotonic() < deadline, f"node {node.port} does not know all {wanted} nodes"
            time.sleep(0.1)
    # Ok, and it has learnt who serves each slot (cluster_state:ok alone is not that: the nodes run
    # with cluster-require-full-coverage no, and a slot it has no owner for fails a MIGRATE into it).
    while not {"cluster_state:ok", "cluster_slots_assigned:16384"} <= set(new.cli("cluster", "info").split()):
        assert time.monotonic() < deadline, f"node {new.port} not ok, or not knowing who serves every slot"
        time.sleep(0.1)


def forget(nodes: Sequence[ValkeyServer], gone: ValkeyServer) -> None:
    """Forget ``gone`` (holding no slot any more) on every other node (then stop it: valkey-cli's del-node)."""
    gone_id = node_id(gone)
    for node in nodes:
        if node is not gone:
            with _client(node) as client:
                client.execute_command("CLUSTER", "FORGET", gone_id)
