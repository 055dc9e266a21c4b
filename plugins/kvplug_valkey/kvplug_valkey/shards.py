"""The nodes of a ``CLUSTER SHARDS`` reply (every node of the cluster, also one serving no slot,
which ``CLUSTER SLOTS`` leaves out), by the address that redirections name them by."""

from __future__ import annotations

from typing import Any, NamedTuple


class Member(NamedTuple):
    """A node as ``CLUSTER SHARDS`` lists it (also one serving no slot, unlike ``CLUSTER SLOTS``)."""

    name: str
    host: str
    port: int
    #: A primary that is online: it may hold keys ``CLUSTER SLOTS`` does not lead to (a node that
    #: joined and imports its first slot), which a listing scans.
    primary: bool = False


def _fields(entry: Any) -> dict[str, Any]:
    """A ``CLUSTER SHARDS`` map (RESP2: an array of names and values) by field name."""
    pairs = entry.items() if isinstance(entry, dict) else zip(entry[::2], entry[1::2])
    return {k.decode() if isinstance(k, bytes) else str(k): v for k, v in pairs}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else "" if value is None else str(value)


def members(shards: Any, tls: bool) -> dict[str, Member]:
    """Every node of a ``CLUSTER SHARDS`` reply, by the address redirections name it by (its
    endpoint, as ``CLUSTER SLOTS``, ``MOVED`` and ``ASK`` give it, and its TLS port over TLS)."""
    found: dict[str, Member] = {}
    for shard in shards:
        for entry in _fields(shard).get("nodes") or []:
            node = _fields(entry)
            host = _text(node.get("endpoint"))
            port = (node.get("tls-port") if tls else None) or node.get("port")
            if host and host != "?" and port:  # ("?": a node that has no endpoint to announce)
                role, health = (_text(node.get(field)) for field in ("role", "health"))
                member = Member(
                    f"{host}:{int(port)}", host, int(port), role in ("master", "primary") and health == "online"
                )
                found[member.name] = member
    return found
