"""What the valkey tier writes and reads, checked against the server with a plain client:
records bound to their key, corrupt/swapped/foreign values are misses (counted, deleted),
TTLs, key prefixes, pipelining, and cluster detection."""

from __future__ import annotations

import time

import valkey
from valkey_helpers import fresh_prefix

from kvplug import RECORD_HEADER_SIZE, key_digest, unpack_record
from kvplug.testing import key_for, value_for


def plain_client(server) -> valkey.Valkey:
    return valkey.Valkey(host="127.0.0.1", port=server.port, socket_timeout=5)


def stored_name(prefix: str, key: str) -> bytes:
    return (prefix + key_digest(key).hex()).encode()


def test_values_are_key_bound_records_under_the_prefix(valkey_server, tiers) -> None:
    prefix = fresh_prefix()
    tier = tiers(valkey_server.url, key_prefix=prefix)
    key, value = key_for("rec"), value_for("rec", 5000)
    tier.put([(key, value)])
    client = plain_client(valkey_server)
    data = client.get(stored_name(prefix, key))
    assert data is not None and len(data) == RECORD_HEADER_SIZE + len(value)
    assert bytes(unpack_record(data, key)) == value
    assert [n.decode() for n in client.scan_iter(match=prefix + "*")] == [stored_name(prefix, key).decode()]


def test_corrupt_swapped_and_foreign_values_are_misses_counted_and_deleted(valkey_server, tiers) -> None:
    prefix = fresh_prefix()
    tier = tiers(valkey_server.url, key_prefix=prefix)
    keys = [key_for(f"bad-{i}") for i in range(4)]
    tier.put([(k, value_for(k, 3000)) for k in keys])
    client = plain_client(valkey_server)
    names = [stored_name(prefix, k) for k in keys]
    flipped = bytearray(client.get(names[0]))
    flipped[-1] ^= 0x01
    client.set(names[0], bytes(flipped))  # a bit flip in the value
    client.set(names[1], client.get(names[2]))  # another key's record under this name
    client.delete(names[3])
    client.rpush(names[3], b"not a string")  # another program's list under our prefix
    got = tier.get(keys)
    assert got[0] is None and got[1] is None and got[3] is None
    assert bytes(got[2]) == value_for(keys[2], 3000)
    assert tier.stats().extra["corrupt"] == 3
    assert client.exists(names[0], names[1], names[3]) == 0  # deleted
    assert tier.contains(keys) == [False, False, True, False]


def test_truncated_value_is_not_contained_nor_returned(valkey_server, tiers) -> None:
    prefix = fresh_prefix()
    tier = tiers(valkey_server.url, key_prefix=prefix)
    key = key_for("short")
    plain_client(valkey_server).set(stored_name(prefix, key), b"KVPR-truncated")
    assert tier.contains([key]) == [False]
    assert tier.get([key]) == [None]


def test_ttl_expires_values(valkey_server, tiers) -> None:
    tier = tiers(valkey_server.url, ttl_s=1.5)
    tier.put([(key_for("ttl"), b"v" * 100)])
    assert tier.contains([key_for("ttl")]) == [True]
    deadline = time.monotonic() + 10  # the server expires it 1.5 s after the put; allow a stalled machine
    while tier.contains([key_for("ttl")]) != [False]:
        assert time.monotonic() < deadline, "the value did not expire"
        time.sleep(0.1)
    assert tier.get([key_for("ttl")]) == [None]


def test_big_batches_are_pipelined_in_groups_and_keep_order(valkey_server, tiers) -> None:
    tier = tiers(valkey_server.url, pipeline_keys=3, pipeline_bytes=10_000)
    keys = [key_for(f"batch-{i}") for i in range(25)]
    values = [value_for(k, 1000 + 97 * i) for i, k in enumerate(keys)]
    tier.put(list(zip(keys, values)))
    assert tier.stats().puts == 25
    assert [bytes(v) for v in tier.get(keys)] == values
    assert tier.contains([*keys[::-1], key_for("absent")]) == [True] * 25 + [False]


def test_the_smallest_pool_allowed_serves_batches_of_many_pipelines(valkey_server, tiers) -> None:
    """Connections only just over the pipelines in flight: no call is refused for want of one."""
    tier = tiers(valkey_server.url, max_concurrency=3, max_connections=4, pipeline_keys=2, scan_on_start=True)
    keys = [key_for(f"pool-{i}") for i in range(60)]
    values = [value_for(k, 2000) for k in keys]
    tier.put(list(zip(keys, values)))
    assert [bytes(v) for v in tier.get(keys)] == values
    assert tier.contains(keys) == [True] * 60
    stats = tier.stats()
    assert stats.puts == 60 and stats.extra["failures"] == 0 and stats.extra["breaker_opens"] == 0


def test_prefixes_keep_tiers_apart(valkey_server, tiers) -> None:
    one, two = tiers(valkey_server.url), tiers(valkey_server.url)
    one.put([(key_for("shared"), b"one" * 30)])
    assert two.contains([key_for("shared")]) == [False]


def test_cluster_is_detected_and_keys_spread_over_every_node(valkey_cluster, tiers) -> None:
    prefix = fresh_prefix()
    tier = tiers(valkey_cluster.url, key_prefix=prefix)
    keys = [key_for(f"spread-{i}") for i in range(60)]
    tier.put([(k, value_for(k, 2000)) for k in keys])
    assert tier.stats().extra["cluster"] == "true"
    per_node = [
        len(list(valkey.Valkey(host="127.0.0.1", port=port).scan_iter(match=prefix + "*")))
        for port in valkey_cluster.ports
    ]
    assert sum(per_node) == 60 and all(n > 0 for n in per_node), per_node
    assert [bytes(v) for v in tier.get(keys)] == [value_for(k, 2000) for k in keys]


def test_standalone_is_detected(valkey_server, tiers) -> None:
    tier = tiers(valkey_server.url)
    tier.contains([key_for("x")])
    assert tier.stats().extra["cluster"] == "false"


def test_unix_socket_url(tmp_path, tiers) -> None:
    from kvplug_valkey.testing import ValkeyServer

    socket_path = tmp_path / "v.sock"
    with ValkeyServer(tmp_path / "unix", extra_args=["--unixsocket", str(socket_path), "--unixsocketperm", "700"]):
        tier = tiers(f"unix://{socket_path}?db=3")
        tier.put([(key_for("unix"), b"u" * 500)])
        assert bytes(tier.get([key_for("unix")])[0]) == b"u" * 500
        assert tier.stats().extra["url"] == f"unix://{socket_path}?db=3"
