"""Fixtures of the valkey tier tests: real valkey-server processes on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from valkey_helpers import make_valkey_tier

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
