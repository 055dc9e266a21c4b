"""Fixtures of the valkey tier tests: real valkey-server processes on 127.0.0.1."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvplug.testing import tier_context
from kvplug_valkey import ValkeyTier
from kvplug_valkey.testing import ValkeyCluster, ValkeyServer


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    """One standalone server for the session (tests use fresh key prefixes)."""
    with ValkeyServer(tmp_path_factory.mktemp("valkey")) as server:
        yield server


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """A 3-master cluster for the session."""
    with ValkeyCluster(tmp_path_factory.mktemp("valkey-cluster")) as cluster:
        yield cluster


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[ValkeyServer]:
    """A server of this test alone (to kill, pause, fill or protect with a password)."""
    server = ValkeyServer(tmp_path / "own")
    yield server
    server.kill()


def fresh_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}:"


#: Settings that make faults show within a fraction of a second.
FAST_FAILING: dict[str, Any] = {
    "connect_timeout_s": 0.2,
    "request_timeout_s": 0.3,
    "retries": 1,
    "backoff_base_s": 0.01,
    "backoff_max_s": 0.02,
    "breaker_failures": 3,
    "breaker_cooldown_s": 0.5,
}


def make_valkey_tier(url: str, **options: Any) -> ValkeyTier:
    options.setdefault("key_prefix", fresh_prefix())
    return ValkeyTier(ValkeyTier.Config(url=url, **options), tier_context())


@pytest.fixture
def tiers() -> Iterator[Callable[..., ValkeyTier]]:
    """Make tiers closed at the end of the test."""
    made: list[ValkeyTier] = []

    def make(url: str, **options: Any) -> ValkeyTier:
        tier = make_valkey_tier(url, **options)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
