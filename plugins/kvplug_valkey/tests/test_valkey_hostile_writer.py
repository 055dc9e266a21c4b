"""What a writer of the server can make a reader do: a value too big for any record of the
engine is a miss, and the server sends no more of it than the bound."""

from __future__ import annotations

import valkey
from valkey_helpers import fresh_prefix

from kvplug import key_digest
from kvplug.core.records.frame import pack_record
from kvplug.testing import key_for, tier_context, value_for
from kvplug_valkey import ValkeyTier

#: The largest record the reading engine can store or read (its ``max_record_bytes``).
BOUND = 64 + 64 * 1024
#: A planted value far over the bound: reading it whole would cost a reader this much.
PLANTED = 64 * 1024**2


def sent_bytes(client: valkey.Valkey) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def test_a_value_over_the_record_bound_is_a_miss_the_server_does_not_send(valkey_server) -> None:
    prefix = fresh_prefix()
    config = ValkeyTier.Config(url=valkey_server.url, key_prefix=prefix, request_timeout_s=10.0)
    tier = ValkeyTier(config, tier_context(max_record_bytes=BOUND))
    client = valkey.Valkey.from_url(valkey_server.url)
    try:
        victim, other = key_for("planted"), key_for("kept")
        tier.put([(victim, value_for("planted", 4096)), (other, value_for("kept", 4096))])
        name = prefix.encode() + key_digest(victim).hex().encode()
        # A whole, valid record of the victim's key: only its size gives it away.
        client.set(name, pack_record(victim, b"\x07" * PLANTED))
        before = sent_bytes(client)
        got = tier.get([victim, other, key_for("never stored")])
        sent = sent_bytes(client) - before
        assert got[0] is None and bytes(got[1]) == value_for("kept", 4096) and got[2] is None
        assert sent < PLANTED // 4, f"the server sent {sent} bytes for a {PLANTED}-byte value"
        assert tier.stats().extra["corrupt"] == 1
        assert client.exists(name) == 0  # removed, as any corrupt record
        assert tier.contains([victim, other]) == [False, True]
    finally:
        tier.close()
        client.close()
