"""The tier's index of its keys stays bounded and close to what a real server holds: a
server that evicts (``maxmemory`` with ``allkeys-lru``) while this process keeps storing,
another program filling the server, and an index bound smaller than the keys stored.
(The index itself, kvplug.core.records.index.RecordIndex, is unit-tested in tests/test_record_index.py.)"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import valkey
from valkey_helpers import FAST_FAILING, fresh_prefix

from kvplug import RECORD_HEADER_SIZE, KVEvent, key_digest
from kvplug.core.records.index import CHECKS_PER_NEW_KEY, CHECKS_PER_ROUND  # the round's pace, not public API
from kvplug.testing import key_for, tier_context
from kvplug_valkey import ValkeyTier
from kvplug_valkey.testing import ValkeyServer

#: Documented slack of stats() over the server when this process is the only writer of
#: chunks of one size: about a third (kvplug_valkey.tier); the assertion allows half.
SLACK = 1.5
VALUE_BYTES = 400


def plain_client(server: ValkeyServer) -> valkey.Valkey:
    return valkey.Valkey(host="127.0.0.1", port=server.port, socket_timeout=10)


def held_by_server(client: valkey.Valkey, prefix: str) -> tuple[int, int]:
    """(keys, value bytes) the server really holds under ``prefix``: SCAN and STRLEN."""
    names = list(client.scan_iter(match=prefix + "*", count=1000))
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.strlen(name)
    lengths = [int(n) for n in pipe.execute()]
    return len(names), sum(n - RECORD_HEADER_SIZE for n in lengths if n > 0)


@pytest.fixture
def lru_server(tmp_path: Path):
    """A server of this test alone that holds a few thousand small values, then evicts."""
    with ValkeyServer(tmp_path / "lru", maxmemory="3mb", maxmemory_policy="allkeys-lru") as server:
        yield server


def test_index_stays_near_what_an_evicting_server_holds(lru_server, tiers) -> None:
    prefix = fresh_prefix()
    tier = tiers(lru_server.url, key_prefix=prefix, pipeline_keys=256)
    client = plain_client(lru_server)
    value = b"v" * VALUE_BYTES
    total = 15_000  # several times what 3 MiB holds: most keys are evicted by the server
    for start in range(0, total, 500):
        tier.put([(key_for(f"lru-{i}"), value) for i in range(start, start + 500)])
    assert int(client.info("stats")["evicted_keys"]) > total // 2, "the server did not evict: the test proves nothing"
    live_keys, live_bytes = held_by_server(client, prefix)
    assert 0 < live_keys < total // 3
    stats = tier.stats()
    assert stats.puts == total
    # The index follows the server down instead of growing with every put (main held 15,000).
    assert stats.items <= live_keys * SLACK, (stats.items, live_keys, stats.extra)
    assert stats.bytes_used <= live_bytes * SLACK, (stats.bytes_used, live_bytes)
    assert stats.extra["items_are"] == "estimate"
    # Every key put left the index by a check that found it gone, or is still in it.
    assert stats.extra["index_dropped_full"] == 0
    assert stats.extra["index_found_gone"] + stats.items == total
    # What the index kept is mostly what the server holds, not long-gone keys.
    assert stats.items >= live_keys // 2


def test_reads_of_keys_another_program_pushed_out_drop_them(lru_server, tiers) -> None:
    prefix = fresh_prefix()
    tier = tiers(lru_server.url, key_prefix=prefix)
    keys = [key_for(f"pushed-{i}") for i in range(300)]
    tier.put([(key, b"p" * VALUE_BYTES) for key in keys])
    assert tier.stats().items == 300
    client = plain_client(lru_server)
    filler = b"f" * 1000
    for batch in range(40):  # ~10 MB of another program's values into a 3 MiB server
        pipe = client.pipeline(transaction=False)
        for i in range(250):
            pipe.set(f"other:{batch}:{i}", filler)
        pipe.execute()
    # The server evicts on any command while it is over maxmemory (a GET pipeline's replies count),
    # so it would go on dropping keys between the snapshot below and the reads after it.
    client.config_set("maxmemory", "0")
    names = [(prefix + key_digest(key).hex()).encode() for key in keys]
    alive = [client.exists(name) == 1 for name in names]
    gone = alive.count(False)
    assert gone > 150, f"only {gone} of 300 keys were evicted: the test proves nothing"
    assert tier.stats().items == 300  # nothing told this process yet: the estimate is stale
    # A lookup (STRLEN) and a read (GET) that miss drop the keys the server no longer holds.
    answers = tier.contains(keys[:150])
    values = tier.get(keys[150:])
    assert answers == alive[:150]
    assert [v is not None for v in values] == alive[150:]
    stats = tier.stats()
    assert stats.items == 300 - gone == alive.count(True)
    assert stats.bytes_used == VALUE_BYTES * alive.count(True)
    assert stats.extra["index_found_gone"] == gone


def test_index_holds_at_most_index_max_keys_and_forgets_without_deleting(valkey_server, tiers, caplog) -> None:
    caplog.set_level(logging.WARNING)
    prefix = fresh_prefix()
    tier = tiers(valkey_server.url, key_prefix=prefix, pipeline_keys=256, index_max_keys=1_000)
    keys = [key_for(f"bound-{i}") for i in range(5_000)]
    for start in range(0, len(keys), 500):
        tier.put([(key, b"b" * 100) for key in keys[start : start + 500]])
    stats = tier.stats()
    assert stats.items == 1_000 and stats.bytes_used == 100_000
    assert stats.extra["index_max_keys"] == 1_000 and stats.extra["index_dropped_full"] == 4_000
    assert held_by_server(plain_client(valkey_server), prefix)[0] == 5_000  # forgotten, not deleted
    assert stats.evictions == 0
    # Forgetting is said once, not once per key.
    full = [r for r in caplog.records if "index_max_keys=1000" in r.getMessage()]
    assert len(full) == 1 and "forgotten, not deleted" in full[0].getMessage()
    # A forgotten key is still served, and enters the index again as the most recently used.
    assert bytes(tier.get([keys[0]])[0]) == b"b" * 100
    assert tier.stats().items == 1_000


def test_index_max_keys_must_be_positive_and_bounded(valkey_server, tiers) -> None:
    for bad in (0, 10**9):
        with pytest.raises(ValueError, match="index_max_keys"):
            tiers(valkey_server.url, index_max_keys=bad)


def test_with_max_bytes_keys_pushed_out_of_a_full_index_are_evicted_not_forgotten(valkey_server) -> None:
    # The index covers 200 keys of 1,000 bytes (~200 kB); max_bytes allows 400 kB; 2,000 keys
    # (2 MB) are stored. Forgotten instead of deleted, they would all stay in the server.
    prefix, budget, value_bytes = fresh_prefix(), 400_000, 1_000
    events: list[KVEvent] = []
    config = ValkeyTier.Config(
        url=valkey_server.url, key_prefix=prefix, max_bytes=budget, index_max_keys=200, request_timeout_s=5.0
    )
    tier = ValkeyTier(config, tier_context(emit=events.append))
    client = plain_client(valkey_server)
    try:
        keys = [key_for(f"capped-{i}") for i in range(2_000)]
        for start in range(0, len(keys), 100):
            tier.put([(key, b"c" * value_bytes) for key in keys[start : start + 100]])
            held_keys, held_bytes = held_by_server(client, prefix)
            assert held_bytes <= budget, (start, held_keys, held_bytes, tier.stats().extra)
        assert (held_keys, held_bytes) == (200, 200 * value_bytes)
        stats = tier.stats()
        assert stats.items == 200 and stats.evictions == 1_800
        assert stats.extra["index_dropped_full"] == 0  # evicted, not forgotten
        # Reads of pushed-out keys miss; the last keys stored are still served.
        assert tier.get(keys[:5]) == [None] * 5
        read = keys[-5:]
        assert [bytes(v or b"") for v in tier.get(read)] == [b"c" * value_bytes] * 5
        more = [key_for(f"capped-more-{i}") for i in range(200)]
        tier.put([(key, b"m" * value_bytes) for key in more])
        assert held_by_server(client, prefix) == (200, 200 * value_bytes)
        assert tier.stats().evictions == 2_000
        # Every eviction is reported by name, once: the index keeps the text of keys stored
        # and read (kvplug.RecordTier). The read keys were evicted last, by the final put.
        evicted = [key for event in events if event.kind == "evicted" for key in event.keys]
        assert sorted(evicted) == sorted(keys)
        assert set(read) <= set(evicted[-200:])
    finally:
        tier.close()


def test_the_round_of_checks_does_not_refresh_the_servers_lru_of_checked_keys(valkey_server, tiers) -> None:
    # STRLEN makes a key look freshly used to the server, EXISTS does not: a round that read
    # the keys it checks would keep this process's cold chunks alive in a shared LRU server.
    prefix = fresh_prefix()
    tier = tiers(valkey_server.url, key_prefix=prefix)
    keys = [key_for(f"idle-{i}") for i in range(50)]
    tier.put([(key, b"i" * 100) for key in keys])  # 50 new keys: the whole index is checked now
    client = plain_client(valkey_server)
    names = [prefix + key_digest(key).hex() for key in keys]
    client.delete(*names[:5])  # gone, so that the next round is seen to run
    time.sleep(3.0)
    tier.put([(key_for("idle-new"), b"n" * 100)])  # 1 new key: the round checks the next 20, oldest first
    due = CHECKS_PER_NEW_KEY + CHECKS_PER_ROUND
    assert tier.stats().extra["index_found_gone"] == 5, "the round did not check the oldest keys"
    idle = [int(client.object("idletime", name)) for name in names[5:due]]
    assert min(idle) >= 2, f"checked keys look freshly used to the server: idle times {idle}"


def test_a_put_that_failed_does_not_also_pay_for_a_round_of_checks(own_server, tiers) -> None:
    # A hung server: the put's groups time out (retries + 1 attempts, each counted as a
    # failure). A round of checks after it would time out as well, doubling the put's cost
    # until the breaker opens.
    own_server.start()
    tier = tiers(own_server.url, **{**FAST_FAILING, "breaker_failures": 10})
    tier.put([(key_for(f"hung-{i}"), b"h" * 100) for i in range(50)])
    assert tier.stats().extra["failures"] == 0
    own_server.pause()
    try:
        tier.put([(key_for("hung-new"), b"n" * 100)])
    finally:
        own_server.resume()
    extra = tier.stats().extra
    assert extra["dropped_puts"] == 1
    assert extra["failures"] == FAST_FAILING["retries"] + 1, extra
    assert extra["breaker_state"] == "closed"


def test_scan_on_start_indexes_the_keys_already_stored_and_applies_max_bytes(valkey_server, tiers) -> None:
    prefix = fresh_prefix()
    writer = tiers(valkey_server.url, key_prefix=prefix)
    keys = [key_for(f"before-{i}") for i in range(30)]
    writer.put([(key, b"s" * 1_000) for key in keys])
    plain_client(valkey_server).set(prefix + "not-a-digest", b"another program's key")
    assert tiers(valkey_server.url, key_prefix=prefix).stats().items == 0  # scan_on_start is off by default
    scanning = tiers(valkey_server.url, key_prefix=prefix, scan_on_start=True, max_bytes=20_000)
    scanning.flush()  # waits for the listing (SCAN under the prefix), then applies max_bytes to it
    stats = scanning.stats()
    assert stats.items == 20 and stats.bytes_used == 20_000 and stats.evictions == 10
    client = plain_client(valkey_server)
    assert client.exists(prefix + "not-a-digest") == 1  # not a record name: never listed, never deleted
    client.delete(prefix + "not-a-digest")
    assert held_by_server(client, prefix) == (20, 20_000)  # 10 of them were deleted (a listing has no ages)


def test_keys_found_gone_from_the_server_are_reported_removed_for_routers(lru_server) -> None:
    # The engine announced these chunks as stored in "valkey" (BlockStored, medium=valkey);
    # the server's LRU then dropped many of them. Once a lookup, a read or the round of
    # checks finds one gone, a router must hear of it, or it keeps sending its prompts here.
    prefix, events = fresh_prefix(), []
    config = ValkeyTier.Config(url=lru_server.url, key_prefix=prefix, request_timeout_s=5.0)
    tier = ValkeyTier(config, tier_context(emit=events.append))
    try:
        keys = [key_for(f"routed-{i}") for i in range(300)]
        tier.put([(key, b"r" * VALUE_BYTES) for key in keys])
        client = plain_client(lru_server)
        for batch in range(40):  # ~10 MB of another program's values into a 3 MiB server
            pipe = client.pipeline(transaction=False)
            for i in range(250):
                pipe.set(f"other:{batch}:{i}", b"f" * 1000)
            pipe.execute()
        client.config_set("maxmemory", "0")  # no more evictions after the snapshot below
        alive = [client.exists(prefix + key_digest(key).hex()) == 1 for key in keys]
        gone = {key for key, there in zip(keys, alive) if not there}
        assert len(gone) > 150, f"only {len(gone)} of 300 keys were evicted: the test proves nothing"
        assert tier.contains(keys[:100]) == alive[:100]
        assert [v is not None for v in tier.get(keys[100:200])] == alive[100:200]
        found = [key for event in events if event.kind == "removed" for key in event.keys]
        assert sorted(found) == sorted(gone & set(keys[:200]))
        # The rest are found by the round of checks that puts run (EXISTS), a few each time.
        for i in range(60):
            tier.put([(key_for(f"routed-more-{i}"), b"m" * VALUE_BYTES)])
        removed = [event for event in events if event.kind == "removed"]
        assert {event.tier for event in removed} == {"valkey"}
        found = [key for event in removed for key in event.keys]
        assert sorted(found) == sorted(gone), "each key found gone is reported once"
        assert tier.stats().extra["index_found_gone"] == len(gone)
    finally:
        tier.close()


def test_inspecting_records_does_not_refresh_the_servers_lru_of_them(valkey_server, tiers) -> None:
    # `kvplug store verify` and `kvplug explain` read records with read_record (the backend's
    # peek): inspection, not a use. A GET makes a key look freshly used to the server:
    # verifying a shared server would reorder its whole eviction. The engine's reads (get)
    # still count as uses, also on the connection the inspection used (one at a time here).
    prefix = fresh_prefix()
    tier = tiers(valkey_server.url, key_prefix=prefix, max_concurrency=1, max_connections=2)
    keys = [key_for(f"inspected-{i}") for i in range(20)]
    tier.put([(key, b"i" * 100) for key in keys])
    client = plain_client(valkey_server)
    names = [prefix + key_digest(key).hex() for key in keys]
    time.sleep(3.0)
    read = [tier.read_record(key_digest(key).hex()) for key in keys]
    assert all(data is not None and len(data) == RECORD_HEADER_SIZE + 100 for data in read)
    idle = [int(client.object("idletime", name)) for name in names]
    assert min(idle) >= 2, f"inspected keys look freshly used to the server: idle times {idle}"
    # No connection keeps the flag: the next reads are uses.
    assert [bytes(v or b"") for v in tier.get(keys)] == [b"i" * 100] * 20
    assert max(int(client.object("idletime", name)) for name in names) <= 1
