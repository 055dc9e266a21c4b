"""The record format stays byte-compatible. The raw values the 0.2 release's valkey
tier stored (every key it wrote, read with ``GET`` and dumped to ``tests/compat/release_0_2/valkey``
by ``tests/compat/write_release_store.py``) are ``SET`` under their names into a fresh server
with a plain client: today's tier reads them, writes the very same keys and bytes, and takes a
damaged one for a counted miss; each without an integrity key (record v1) and with one (v2)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import valkey

# The fixtures and their reader live with the core's compat tests (one reader for every tier).
_READER = Path(__file__).resolve().parents[3] / "tests" / "compat" / "release_store.py"
_spec = importlib.util.spec_from_file_location("kvplug_compat_release_store", _READER)
assert _spec is not None and _spec.loader is not None
release = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(release)

PREFIX = release.MANIFEST["tiers"]["valkey"]["key_prefix"]


@pytest.fixture(params=release.MODES)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with release.integrity_key_of(request.param, monkeypatch):
        yield request.param


@pytest.fixture
def server(own_server):
    """A fresh server: the release's names, nothing else."""
    return own_server.start()


def plain_client(server) -> valkey.Valkey:
    return valkey.Valkey(host="127.0.0.1", port=server.port, socket_timeout=5)


def load_release(server, mode: str, damage: Callable[[bytes], bytes] = bytes) -> list[str]:
    """SET the release's raw values; the keys they were stored for."""
    with plain_client(server) as client:
        for name, data in release.release_records("valkey", mode).items():
            client.set(name, damage(data))
    return [key for key, _ in release.release_items()]


def test_release_records_are_read(mode: str, server, tiers) -> None:
    keys = load_release(server, mode)
    tier = tiers(server.url, key_prefix=PREFIX)
    assert tier.contains(keys) == [True] * len(keys)
    got = tier.get(keys)
    assert [None if value is None else bytes(value) for value in got] == [v for _, v in release.release_items()]
    assert tier.stats().extra.get("corrupt", 0) == 0


def test_writes_the_release_bytes(mode: str, server, tiers) -> None:
    tier = tiers(server.url, key_prefix=PREFIX)
    tier.put(release.release_items())
    tier.flush()
    with plain_client(server) as client:
        stored = {name.decode(): client.get(name) for name in client.scan_iter(match="*")}
    expected = release.release_records("valkey", mode)
    assert sorted(stored) == sorted(expected)
    for name, data in expected.items():
        assert stored[name] == data, f"valkey {mode}: {name} differs from the release's record"


def test_a_flipped_byte_is_a_counted_corrupt_miss(mode: str, server, tiers) -> None:
    keys = load_release(server, mode, damage=release.flip_one_byte)
    tier = tiers(server.url, key_prefix=PREFIX)
    assert tier.get(keys) == [None] * len(keys)
    assert tier.stats().extra["corrupt"] == len(keys)
    assert tier.contains(keys) == [False] * len(keys)  # a corrupt record is deleted
