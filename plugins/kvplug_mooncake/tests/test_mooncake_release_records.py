"""The record format stays byte-compatible. The raw objects the 0.2 release's
mooncake tier stored (read back with a plain client's ``get`` and dumped to
``tests/compat/release_0_2/mooncake`` by ``tests/compat/write_release_store.py``) are put under
their names into the store with a plain client: today's tier reads them, writes the very same
objects, and takes a damaged one for a counted miss; each without an integrity key (record v1)
and with one (v2). The names are the fixtures' own keys, removed before and after each test,
so the session's cluster serves as a fresh store."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# The fixtures and their reader live with the core's compat tests (one reader for every tier).
_READER = Path(__file__).resolve().parents[3] / "tests" / "compat" / "release_store.py"
_spec = importlib.util.spec_from_file_location("kvplug_compat_release_store", _READER)
assert _spec is not None and _spec.loader is not None
release = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(release)

PREFIX = release.MANIFEST["tiers"]["mooncake"]["key_prefix"]
OBJECT_NOT_FOUND = -704


@pytest.fixture(params=release.MODES)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with release.integrity_key_of(request.param, monkeypatch):
        yield request.param


@pytest.fixture(scope="module")
def plain_client(mooncake_cluster) -> Iterator[Any]:
    """A client of the store of its own (no segment), not the tier's."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    options = mooncake_cluster.tier_options
    code = client.setup(
        options["local_hostname"], options["metadata_server"], 0, 16 * 1024**2, "tcp", "", options["master"]
    )
    assert code == 0, f"mooncake client setup failed with {code}"
    yield client
    client.close()


@pytest.fixture
def names(plain_client) -> Iterator[list[str]]:
    """The release's object names, absent from the store before and after the test."""
    names = list(release.release_records("mooncake", "v1"))  # the same names in both modes

    def remove_all() -> None:
        for name in names:
            code = plain_client.remove(name, True)  # force: a lease left by a read must not keep it
            assert code in (0, OBJECT_NOT_FOUND), f"removing {name} failed with {code}"

    remove_all()
    yield names
    remove_all()


def load_release(client: Any, mode: str, damage: Callable[[bytes], bytes] = bytes) -> list[str]:
    """Put the release's raw objects; the keys they were stored for."""
    for name, data in release.release_records("mooncake", mode).items():
        code = client.put(name, damage(data))
        assert code == 0, f"put of {name} failed with {code}"
    return [key for key, _ in release.release_items()]


def test_release_records_are_read(mode: str, plain_client, names, make_mooncake_tier) -> None:
    keys = load_release(plain_client, mode)
    tier = make_mooncake_tier(key_prefix=PREFIX)
    assert tier.contains(keys) == [True] * len(keys)
    got = tier.get(keys)
    assert [None if value is None else bytes(value) for value in got] == [v for _, v in release.release_items()]
    assert tier.stats().extra.get("corrupt", 0) == 0


def test_writes_the_release_bytes(mode: str, plain_client, names, make_mooncake_tier) -> None:
    tier = make_mooncake_tier(key_prefix=PREFIX)
    tier.put(release.release_items())
    tier.flush()
    for name, data in release.release_records("mooncake", mode).items():
        assert plain_client.get_size(name) == len(data), name
        assert bytes(plain_client.get(name)) == data, f"mooncake {mode}: {name} differs from the release's record"


def test_a_flipped_byte_is_a_counted_corrupt_miss(mode: str, plain_client, names, make_mooncake_tier) -> None:
    keys = load_release(plain_client, mode, damage=release.flip_one_byte)
    tier = make_mooncake_tier(key_prefix=PREFIX)
    assert tier.get(keys) == [None] * len(keys)
    assert tier.stats().extra["corrupt"] == len(keys)
    assert tier.contains(keys) == [False] * len(keys)  # a corrupt record is kept, absent to this tier
