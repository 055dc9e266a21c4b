"""A corrupt value is deleted only if the server still holds it (a script compares and
deletes at once): a good record another client stored under its key since it was read
survives, in the tier's reads and in ``kvplug store gc``."""

from __future__ import annotations

import pytest
import valkey
from valkey_helpers import fresh_prefix

from kvplug import RECORD_HEADER_SIZE, TierContext, key_digest
from kvplug.cli.store import _check_all
from kvplug.testing import key_for, tier_context, value_for
from kvplug.testing.corrupt_races import (
    check_remove_if_same_keeps_a_newer_value,
    storing_after_gc_read,
    storing_before_corrupt_removal,
)
from kvplug_valkey import ValkeyTier

KEY = key_for("raced")
VALUE = value_for("raced", 3000)
DAMAGES = ["flipped-bit", "over-the-bound", "foreign-type"]


def plain_client(server) -> valkey.Valkey:
    return valkey.Valkey(host="127.0.0.1", port=server.port, socket_timeout=5)


def damage(client: valkey.Valkey, name: bytes, how: str) -> None:
    data = bytearray(client.get(name))
    if how == "flipped-bit":
        data[RECORD_HEADER_SIZE + 5] ^= 1
        client.set(name, bytes(data))
    elif how == "over-the-bound":
        client.set(name, bytes(data) + b"x" * 10_000)
    else:
        client.delete(name)
        client.rpush(name, b"another program's list")


def context_for(how: str) -> TierContext:
    """The tier's context: with a bound on records that the over-long value breaks."""
    return tier_context(max_record_bytes=8192 if how == "over-the-bound" else None)


@pytest.mark.parametrize("how", DAMAGES)
def test_a_good_record_stored_after_the_corrupt_read_is_not_deleted(valkey_server, tiers, how: str) -> None:
    prefix = fresh_prefix()
    name = (prefix + key_digest(KEY).hex()).encode()
    client = plain_client(valkey_server)
    config = ValkeyTier.Config(url=valkey_server.url, key_prefix=prefix, request_timeout_s=5.0)
    other = ValkeyTier(config, context_for(how))  # another engine on the same server
    stored_again: list[bool] = []

    def store_again() -> None:
        other.put([(KEY, VALUE)])
        stored_again.append(True)

    RacedTier = storing_before_corrupt_removal(ValkeyTier, store_again)
    tier = RacedTier(config, context_for(how))
    try:
        other.put([(KEY, VALUE)])
        damage(client, name, how)
        assert tier.get([KEY]) == [None]
        assert stored_again and tier.stats().extra["corrupt"] == 1
        assert client.exists(name) == 1, "the good record another client stored was deleted"
        assert [bytes(v) for v in tier.get([KEY]) if v is not None] == [VALUE]
    finally:
        tier.close()
        other.close()


@pytest.mark.parametrize("how", DAMAGES)
def test_a_corrupt_value_nobody_replaced_is_deleted(valkey_server, tiers, how: str) -> None:
    prefix = fresh_prefix()
    tier = ValkeyTier(ValkeyTier.Config(url=valkey_server.url, key_prefix=prefix), context_for(how))
    name = (prefix + key_digest(KEY).hex()).encode()
    client = plain_client(valkey_server)
    tier.put([(KEY, VALUE)])
    damage(client, name, how)
    assert tier.get([KEY]) == [None]
    assert client.exists(name) == 0
    assert tier.contains([KEY]) == [False]
    tier.close()


def test_gc_keeps_a_good_record_stored_after_it_read_the_corrupt_one(valkey_server, tiers) -> None:
    prefix = fresh_prefix()
    name = (prefix + key_digest(KEY).hex()).encode()
    client = plain_client(valkey_server)
    other = tiers(valkey_server.url, key_prefix=prefix)
    other.put([(KEY, VALUE)])
    damage(client, name, "flipped-bit")

    RacedTier = storing_after_gc_read(ValkeyTier, lambda: other.put([(KEY, VALUE)]))
    tier = RacedTier(ValkeyTier.Config(url=valkey_server.url, key_prefix=prefix), other.context)
    try:
        verdicts = _check_all(tier, remove=True)
    finally:
        tier.close()
    assert verdicts["corrupt"] == 1 and verdicts["removed"] == 0
    assert client.exists(name) == 1, "gc deleted the good record stored after its read"
    reader = tiers(valkey_server.url, key_prefix=prefix)
    assert [bytes(v) for v in reader.get([KEY]) if v is not None] == [VALUE]


def test_a_user_the_server_lets_run_no_scripts_keeps_corrupt_values_without_failing(valkey_server) -> None:
    """An ACL user without ``@scripting``: the compare-and-delete is refused. That is no failure
    of the server (the breaker stays closed): the value is kept, absent to the tier, until stored
    again; ``kvplug store gc`` then removes it by name."""
    prefix = fresh_prefix()
    name = (prefix + key_digest(KEY).hex()).encode()
    client = plain_client(valkey_server)
    user = f"noscripts-{prefix.rstrip(':')}"
    client.execute_command("ACL", "SETUSER", user, "on", ">secret", "~*", "+@all", "-@scripting")
    config = ValkeyTier.Config(
        url=valkey_server.url, key_prefix=prefix, username=user, password="secret", request_timeout_s=5.0
    )
    tier = ValkeyTier(config, tier_context())
    try:
        tier.put([(KEY, VALUE)])
        damage(client, name, "flipped-bit")
        for _ in range(3):
            assert tier.get([KEY]) == [None]
        stats = tier.stats()
        assert stats.extra["corrupt"] == 3 and stats.extra["failures"] == 0
        assert stats.extra["breaker_state"] == "closed"
        assert client.exists(name) == 1 and tier.contains([KEY]) == [False]
        tier.put([(KEY, VALUE)])
        assert [bytes(v) for v in tier.get([KEY]) if v is not None] == [VALUE]
        damage(client, name, "flipped-bit")
        verdicts = _check_all(tier, remove=True)
        assert verdicts["corrupt"] == 1 and verdicts["removed"] == 1 and client.exists(name) == 0
    finally:
        tier.close()
        client.execute_command("ACL", "DELUSER", user)


def test_remove_if_same_keeps_a_record_another_client_stored_since_the_read(valkey_server) -> None:
    """A load's removal of a value it found unusable (the engine's checks, not the record's)."""
    config = ValkeyTier.Config(url=valkey_server.url, key_prefix=fresh_prefix(), request_timeout_s=5.0)
    tier, other = ValkeyTier(config, tier_context()), ValkeyTier(config, tier_context())  # two engines
    try:
        check_remove_if_same_keeps_a_newer_value(tier, other)
    finally:
        tier.close()
        other.close()
