"""``kvplug store stats|ls|verify|gc redis://...`` on a real valkey-server: list, verify, clean a tampered value."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

import pytest
import valkey
from valkey_helpers import fresh_prefix, make_valkey_tier

from kvplug.testing import key_for, value_for


def kvplug_store(*args: str, **env_extra: str) -> subprocess.CompletedProcess[str]:
    # Only the valkey plugin loads: each command starts faster on a busy CI machine.
    env = dict(os.environ, COLUMNS="250", KVPLUG_PLUGINS="valkey", **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "kvplug.cli.main", "store", *args], env=env, capture_output=True, text=True, timeout=180
    )


def test_store_commands_on_valkey(tmp_path) -> None:
    from kvplug_valkey.testing import ValkeyServer

    with ValkeyServer(tmp_path / "cli", password="cli-secret-9") as server:
        prefix = fresh_prefix()
        tier = make_valkey_tier(server.url, key_prefix=prefix, password="cli-secret-9")
        tier.put([(key_for(f"k{i}"), value_for(f"k{i}", 1000 + i)) for i in range(4)])
        tier.close()
        client = valkey.Valkey(host="127.0.0.1", port=server.port, password="cli-secret-9")
        client.set(b"other-app:key", b"not ours")  # outside the prefix: never listed nor touched
        env = {"REDISCLI_AUTH": "cli-secret-9"}
        location = f"{server.url}?prefix={prefix}"

        stats = kvplug_store("stats", location, **env)
        assert stats.returncode == 0, stats.stderr
        assert re.search(r"(│ records\s*│\s*4 │|^records: 4$)", stats.stdout, re.M), stats.stdout
        assert "cli-secret-9" not in stats.stdout + stats.stderr

        listing = kvplug_store("ls", location, **env)
        assert "4 records in" in listing.stdout and listing.stdout.count("opaque value") == 4, listing.stdout

        victim = next(iter(client.scan_iter(match=prefix + "*")))
        body = bytearray(client.get(victim))
        body[-1] ^= 0x55
        client.set(victim, bytes(body))
        verify = kvplug_store("verify", location, **env)
        digest = victim.decode()[len(prefix) :]
        assert verify.returncode == 1 and f"corrupt: {digest}" in verify.stdout, verify.stdout
        assert kvplug_store("gc", location, **env).returncode == 0
        remaining = list(client.scan_iter(match=prefix + "*"))
        assert victim not in remaining and len(remaining) == 3
        assert client.get(b"other-app:key") == b"not ours"

        wrong = kvplug_store("stats", server.url)  # no password: a clear failure, not a hang nor a traceback
        assert wrong.returncode == 2 and "Authentication required" in wrong.stderr, wrong.stderr
        assert "Traceback" not in wrong.stderr and "cli-secret-9" not in wrong.stdout + wrong.stderr


def test_location_config_answers_only_for_its_urls(monkeypatch) -> None:
    from kvplug_valkey import ValkeyTier

    assert ValkeyTier.location_config("s3://bucket/prefix", {}) is None
    assert ValkeyTier.location_config("/var/cache/kvplug", {}) is None
    monkeypatch.setenv("REDISCLI_AUTH", "from-env-1")
    config = ValkeyTier.location_config("valkey://127.0.0.1:7001/2?prefix=fleet-a:", {})
    assert config is not None and config.key_prefix == "fleet-a:" and config.max_bytes is None
    assert config.address.db == 2 and "prefix" not in config.url
    assert config.password is not None and config.password.get_secret_value() == "from-env-1"
    with pytest.raises(ValueError, match="endpoint_url do not apply to a valkey store"):
        ValkeyTier.location_config("redis://127.0.0.1:7001", {"endpoint_url": "http://127.0.0.1:9000"})


def test_store_commands_read_no_value_past_the_engines_bound(valkey_server, tmp_path) -> None:
    """A 64 MiB value planted under a record name is reported oversized, and the server sends
    none of it (its own count of bytes sent): the bound is the engine's, from max_chunk_bytes."""
    prefix = fresh_prefix()
    tier = make_valkey_tier(valkey_server.url, key_prefix=prefix)
    tier.put([(key_for("k"), value_for("k", 1000))])
    tier.close()
    client = valkey.Valkey(host="127.0.0.1", port=valkey_server.port)
    digest = hashlib.sha256(b"planted").hexdigest()
    client.set(f"{prefix}{digest}".encode(), bytes(64 << 20))
    config = tmp_path / "kvplug.yaml"
    config.write_text("max_chunk_bytes: 1MiB\n")  # the engine's bound: 2 x 1 MiB + 1 MiB + a header
    location = f"{valkey_server.url}?prefix={prefix}"
    for command in ("verify", "ls"):
        sent = int(client.info("stats")["total_net_output_bytes"])
        result = kvplug_store(command, location, KVPLUG_CONFIG=str(config))
        assert "oversized: " in result.stdout and digest in result.stdout, result.stdout + result.stderr
        assert result.returncode == (1 if command == "verify" else 0), result.stderr
        assert int(client.info("stats")["total_net_output_bytes"]) - sent < 16 << 20
    removed = kvplug_store("gc", location, KVPLUG_CONFIG=str(config))
    assert removed.returncode == 0 and re.search(r"│ removed\s*│\s*1 │", removed.stdout), removed.stdout
    assert client.exists(f"{prefix}{digest}".encode()) == 0
