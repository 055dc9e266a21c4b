"""A valkey tier configured wrongly, as an operator meets it: each mistake that no retry
can fix fails once per call without retries, opens the breaker (lookups miss, stores are
dropped, nothing hangs) and is named in the tier's warning."""

from __future__ import annotations

import logging

import pytest
from valkey_helpers import FAST_FAILING

from kvplug.testing import key_for
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
    """A standalone client of a cluster node gets MOVED for the keys of other nodes' slots
    (9729927: a transient ResponseError, retried); the prefixes spread the keys over every
    node, so some are another node's whichever node the url names."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    for prefix in ("a:", "b:", "c:", "d:", "e:", "f:"):
        tier = tiers(valkey_cluster.url, cluster=False, key_prefix=prefix, **FAST_FAILING)
        for _ in range(FAST_FAILING["breaker_failures"]):
            tier.get(KEYS)
        if tier.stats().extra["breaker_state"] == "open":
            break
    else:
        pytest.fail("no prefix put its keys on another node")
    assert tier.stats().extra["retries"] == 0, tier.stats().extra
    assert "is a cluster node" in caplog.text and "set cluster: true" in caplog.text, caplog.text
