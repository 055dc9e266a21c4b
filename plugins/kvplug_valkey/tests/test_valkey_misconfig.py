"""A valkey tier configured wrongly, as an operator meets it: each mistake that no retry
can fix fails once per call without retries, opens the breaker (lookups miss, stores are
dropped, nothing hangs) and is named in the tier's warning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
from valkey_helpers import FAST_FAILING, QUICK_BREAKER

from kvplug.testing import key_for, value_for
from kvplug_valkey.testing import ValkeyCluster, ValkeyServer

KEYS = [key_for(f"misconf-{i}") for i in range(3)]


def assert_permanent(tier, caplog: pytest.LogCaptureFixture, named: str) -> None:
    """Misses until the breaker opens, never a retry, the cause in the warning."""
    for _ in range(FAST_FAILING["breaker_failures"]):
        assert tier.get(KEYS) == [None] * len(KEYS)
    extra = tier.stats().extra
    assert extra["breaker_state"] == "open", extra
    assert extra["retries"] == 0, extra
    assert named in caplog.text, caplog.text


def test_a_database_past_the_servers_count_is_permanent(valkey_server: ValkeyServer, tiers, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    url = valkey_server.url.rsplit("/", 1)[0] + "/99"  # the server has 16 databases
    assert_permanent(tiers(url, **FAST_FAILING), caplog, "DB index is out of range")


def test_a_database_other_than_0_of_a_cluster_is_permanent(valkey_cluster: ValkeyCluster, tiers, caplog) -> None:
    """cluster unset: the tier asks the node, whose SELECT 1 is refused (cluster: true with
    a database is refused by the config already)."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    url = valkey_cluster.url.rsplit("/", 1)[0] + "/1"
    assert_permanent(tiers(url, **FAST_FAILING), caplog, "SELECT is not allowed in cluster mode")


def test_cluster_false_on_a_cluster_node_says_so_without_retries(valkey_cluster: ValkeyCluster, tiers, caplog) -> None:
    """9729927: a standalone client of a cluster node, whose keys on other nodes answered
    MOVED (a transient ResponseError, retried). The prefixes spread the keys over the nodes:
    some are on a node other than the url's."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    for prefix in ("a:", "b:", "c:", "d:", "e:", "f:", "g:", "h:"):
        tier = tiers(valkey_cluster.url, cluster=False, key_prefix=prefix, **FAST_FAILING)
        for _ in range(FAST_FAILING["breaker_failures"]):
            tier.get(KEYS)
        if tier.stats().extra["breaker_state"] == "open":
            break
    else:
        pytest.fail("no prefix put its keys on another node")
    assert tier.stats().extra["retries"] == 0, tier.stats().extra
    assert "is a cluster node (MOVED" in caplog.text and "set cluster: true" in caplog.text, caplog.text


def test_cluster_true_on_a_standalone_server_says_so_without_retries(
    valkey_server: ValkeyServer, tiers, caplog
) -> None:
    """9729927: "no cluster node gave the map of slots", transient, retried; 1ab131a: permanent,
    but not saying what to set."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    tier = tiers(valkey_server.url, cluster=True, **FAST_FAILING)
    assert_permanent(tier, caplog, "Cluster mode is not enabled on this node")
    assert "set cluster: false, or leave it unset" in caplog.text, caplog.text


@pytest.mark.parametrize("cluster", [None, False, True])
def test_a_tls_url_for_a_plain_server_says_so_without_retries(
    cluster: bool | None, valkey_server: ValkeyServer, valkey_cluster: ValkeyCluster, tiers, caplog
) -> None:
    """rediss:// for a server without TLS: its handshake gets no answer (ee9bb23: "Timeout
    connecting to server", transient, retried at every cool-down for ever, nothing said of
    TLS). cluster unset asks the server first (INFO); false goes straight to the reads;
    true reads the map of slots from the cluster's nodes."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    plain = valkey_cluster.url if cluster else valkey_server.url
    url = "rediss://" + plain.split("://", 1)[1]
    tier = tiers(url, cluster=cluster, **FAST_FAILING)
    assert_permanent(tier, caplog, "answers without TLS ('+PONG' to a plain PING)")
    assert "use redis:// or valkey://" in caplog.text, caplog.text


def store_stats(url: str, *options: str, **variables: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KVPLUG_PLUGINS="valkey", **variables)
    command = [sys.executable, "-m", "kvplug.cli.main", "store", "stats", url]
    for option in options:
        command += ["-o", option]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)


def test_store_stats_refuses_cluster_false_on_a_cluster_node(valkey_cluster: ValkeyCluster) -> None:
    """9729927: exit 0 with the records of the url's node alone, as if they were all (its SCAN
    lists its own keys; no MOVED says otherwise)."""
    stats = store_stats(valkey_cluster.url, "cluster=false")
    assert stats.returncode != 0 and "is a cluster node" in stats.stderr, (stats.returncode, stats.stdout, stats.stderr)


def test_a_user_without_info_lists_a_server_as_its_config_says(tmp_path) -> None:
    """An ACL that refuses INFO leaves no way to check cluster: false: it is taken at its word."""
    with ValkeyServer(tmp_path / "acl") as server:
        server.cli("ACL", "SETUSER", "no-info", "on", ">no-info-secret", "~*", "+@all", "-info")
        stats = store_stats(server.url, "cluster=false", "username=no-info", REDISCLI_AUTH="no-info-secret")
        assert stats.returncode == 0, stats.stderr


def test_a_user_without_info_and_cluster_unset_is_told_to_set_cluster(tmp_path, tiers, caplog) -> None:
    """A read-only ACL user (``+@read``) may not run INFO, which cluster unset asks: the tier
    said valkey's "NoPermissionError: User ro has no permissions to run the 'info' command",
    naming no option; ``kvplug store stats`` too."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    with ValkeyServer(tmp_path / "acl") as server:
        server.cli("ACL", "SETUSER", "ro", "on", ">ro-secret", "~*", "+@read", "+@connection")
        tier = tiers(server.url, username="ro", password="ro-secret", **FAST_FAILING)
        assert_permanent(tier, caplog, "refuses the INFO that tells a cluster from a standalone server")
        assert "set cluster: false (a standalone server) or true (a cluster), or allow the user +info" in caplog.text
        stats = store_stats(server.url, "username=ro", REDISCLI_AUTH="ro-secret")
        assert stats.returncode != 0 and "set cluster: false" in stats.stderr, (stats.returncode, stats.stderr)


def sets_refused(server: ValkeyServer) -> int:
    """How many SETs the server refused for want of permission (``INFO commandstats``)."""
    for line in server.cli("INFO", "commandstats").splitlines():
        if line.startswith("cmdstat_set:"):
            fields = dict(part.split("=") for part in line.split(":", 1)[1].split(","))
            return int(fields.get("rejected_calls", 0))
    return 0


def test_a_user_who_may_not_write_keeps_reading(tmp_path, tiers, caplog) -> None:
    """An ACL that allows reads, not SET: stores are dropped and counted, one SET is sent per
    cool-down, and the records the server holds still hit (9729927: NOPERM on the SETs opened
    the tier's breaker, and every lookup missed)."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    values = [value_for(key, 1000) for key in KEYS]
    with ValkeyServer(tmp_path / "acl") as server:
        server.cli(
            "ACL",
            "SETUSER",
            "reader",
            "on",
            ">reader-secret",
            "~*",
            "+@read",
            "+@connection",
            "+client|setname",
            "+info",
        )
        tiers(server.url, key_prefix="ro:").put(list(zip(KEYS, values)))
        reader = tiers(server.url, key_prefix="ro:", username="reader", password="reader-secret", **FAST_FAILING)
        puts = 2 * FAST_FAILING["breaker_failures"]
        for i in range(puts):
            reader.put([(key_for(f"refused-{i}"), values[0])])
        assert [None if v is None else bytes(v) for v in reader.get(KEYS)] == values, reader.stats().extra
        extra = reader.stats().extra
        assert extra["breaker_state"] == "closed" and extra["dropped_puts"] == puts, extra
        assert sets_refused(server) == 1  # then refused without a request until the cool-down
        assert "refuses writes (NOPERM" in caplog.text, caplog.text
        assert extra["refused_puts"] == puts, extra


def test_an_acl_that_refuses_some_keys_keeps_storing_the_others(tmp_path, tiers) -> None:
    """A NOPERM on one key pattern (``%W~ro:*[0-7]``) is that record's refusal, not the
    credential's: the keys the ACL allows are still stored, each refused one dropped (eab791a:
    the first refused SET refused every write, allowed or not, for a whole cool-down)."""
    values = [value_for(key_for("some"), 1000)]
    with ValkeyServer(tmp_path / "acl") as server:
        server.cli("ACL", "SETUSER", "half", "on", ">half-secret", "%R~*", "%W~ro:*[0-7]", "+@all")
        writer = tiers(server.url, key_prefix="ro:", username="half", password="half-secret", **FAST_FAILING)
        puts = 4 * FAST_FAILING["breaker_failures"]
        for i in range(puts):
            writer.put([(key_for(f"some-{i}"), values[0])])
        stored = len(server.cli("KEYS", "ro:*").split())
        extra = writer.stats().extra
        assert extra["breaker_state"] == "closed", extra
        assert 0 < stored < puts, stored  # (the pattern allows about half of the names)
        assert stored + extra["dropped_puts"] == puts, (stored, extra)
        assert extra["refused_puts"] == extra["dropped_puts"], extra  # each dropped one was refused
        assert sets_refused(server) == 1  # then each key is asked about without its value


def net_input_bytes(server: ValkeyServer) -> int:
    """The bytes the server has received from all its clients (``INFO stats``)."""
    for line in server.cli("INFO", "stats").splitlines():
        if line.startswith("total_net_input_bytes:"):
            return int(line.split(":", 1)[1])
    raise AssertionError("INFO stats has no total_net_input_bytes")


def test_a_user_with_no_write_pattern_keeps_reading_without_sending_values(tmp_path, tiers) -> None:
    """``%R~*`` and every command: each SET is refused as a key's (no pattern to write any),
    not as the command's. The values of the stores after the first are not sent, and the
    records the server holds still hit (ee9bb23: every SET was sent, value and all, and
    refused)."""
    value_bytes = 200_000
    values = [value_for(key, value_bytes) for key in KEYS]
    with ValkeyServer(tmp_path / "acl") as server:
        server.cli("ACL", "SETUSER", "nowrite", "on", ">nowrite-secret", "%R~*", "+@all")
        tiers(server.url, key_prefix="nw:").put(list(zip(KEYS, values)))
        reader = tiers(server.url, key_prefix="nw:", username="nowrite", password="nowrite-secret", **FAST_FAILING)
        reader.put([(key_for("refused-first"), values[0])])
        received = net_input_bytes(server)
        puts = 2 * FAST_FAILING["breaker_failures"]
        for i in range(puts):
            reader.put([(key_for(f"refused-{i}"), values[0])])
        sent = net_input_bytes(server) - received
        assert sent < value_bytes, sent  # (ee9bb23: puts * value_bytes)
        assert sets_refused(server) == 1, sets_refused(server)
        assert [None if v is None else bytes(v) for v in reader.get(KEYS)] == values, reader.stats().extra
        extra = reader.stats().extra
        assert extra["breaker_state"] == "closed" and extra["dropped_puts"] == puts + 1, extra


def test_a_cluster_user_who_may_not_write_keeps_reading(valkey_cluster: ValkeyCluster, tiers, caplog) -> None:
    """Every node's ACL refuses SET to the user: its NOPERM is the write's refusal, as on one
    server, and no node's breaker opens (eab791a: each node's NOPERM counted as that node
    failing; once its breaker opened, every key on it missed). The user's name has "key" in
    it: its refusal of the command is still no key's refusal."""
    caplog.set_level(logging.WARNING, logger="kvplug")
    for node in valkey_cluster.nodes:
        node.cli("ACL", "SETUSER", "keyreader", "on", ">keyreader-secret", "~*", "+@all", "-@write")
    keys = [key_for(f"cluster-ro-{i}") for i in range(12)]
    values = [value_for(key, 1000) for key in keys]
    tiers(valkey_cluster.url, key_prefix="cro:").put(list(zip(keys, values)))
    reader = tiers(
        valkey_cluster.url,
        key_prefix="cro:",
        username="keyreader",
        password="keyreader-secret",
        **{**FAST_FAILING, "breaker_cooldown_s": 60.0},  # (no probe SET within the test)
    )
    puts = 4 * FAST_FAILING["breaker_failures"]
    for i in range(puts):
        reader.put([(key_for(f"cluster-refused-{i}"), values[0])])
        assert reader.get(keys[i % len(keys) : i % len(keys) + 1]) != [None], (i, reader.stats().extra)
    assert [None if v is None else bytes(v) for v in reader.get(keys)] == values, reader.stats().extra
    assert reader.stats().extra["dropped_puts"] == puts, reader.stats().extra
    assert "is failing" not in caplog.text and "refuses writes (NOPERM" in caplog.text, caplog.text


def test_a_cluster_acl_that_refuses_some_keys_is_asked_without_values(valkey_cluster: ValkeyCluster, tiers) -> None:
    """The partial pattern on every node of a cluster: the asking goes to each key's node, the
    allowed keys are stored, and one refused SET in all (ee9bb23: each refused key's SET)."""
    for node in valkey_cluster.nodes:
        node.cli("ACL", "SETUSER", "chalf", "on", ">chalf-secret", "%R~*", "%W~cp:*[0-7]", "+@all")
    before = sum(sets_refused(node) for node in valkey_cluster.nodes)
    writer = tiers(valkey_cluster.url, key_prefix="cp:", username="chalf", password="chalf-secret", **QUICK_BREAKER)
    puts = 4 * QUICK_BREAKER["breaker_failures"]
    for i in range(puts):
        writer.put([(key_for(f"cluster-some-{i}"), value_for(key_for("cs"), 1000))])
    stored = sum(len(node.cli("KEYS", "cp:*").split()) for node in valkey_cluster.nodes)
    extra = writer.stats().extra
    assert extra["breaker_state"] == "closed" and 0 < stored < puts, (stored, extra)
    assert stored + extra["dropped_puts"] == puts, (stored, extra)
    assert sum(sets_refused(node) for node in valkey_cluster.nodes) - before == 1


def test_writes_resume_when_the_acl_grants_them_live_and_stop_when_it_revokes(tmp_path, tiers) -> None:
    """``ACL SETUSER`` on a running server: the refused user's writes resume by themselves (the
    cool-down's one write goes through, then all do), and stop again, reads going on, when
    the permission is taken back."""
    with ValkeyServer(tmp_path / "acl") as server:
        server.cli("ACL", "SETUSER", "rotated", "on", ">rotated-secret", "~*", "+@all", "-@write")
        tier = tiers(
            server.url,
            key_prefix="live:",
            username="rotated",
            password="rotated-secret",
            **{**FAST_FAILING, "breaker_cooldown_s": 0.2},
        )
        value = value_for(key_for("live"), 1000)
        tier.put([(key_for("refused"), value)])
        assert server.cli("DBSIZE").strip() == "0"
        server.cli("ACL", "SETUSER", "rotated", "+@write")
        for attempt in range(200):  # (until the cool-down has passed: a bound, not a timing)
            tier.put([(key_for(f"granted-{attempt}"), value)])
            if server.cli("DBSIZE").strip() != "0":
                break
            time.sleep(0.02)
        else:
            pytest.fail("no write went through after the ACL granted SET")
        batch = [(key_for(f"after-{i}"), value) for i in range(4)]
        tier.put(batch)  # all at once, without waiting for another cool-down
        assert all(v is not None for v in tier.get([k for k, _ in batch])), tier.stats().extra
        server.cli("ACL", "SETUSER", "rotated", "-@write")
        dropped = tier.stats().extra["dropped_puts"]
        tier.put([(key_for("revoked"), value)])
        extra = tier.stats().extra
        assert extra["dropped_puts"] == dropped + 1 and extra["breaker_state"] == "closed", extra
        assert all(v is not None for v in tier.get([k for k, _ in batch])), extra
