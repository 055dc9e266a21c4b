"""Fixtures: a real Mooncake cluster on 127.0.0.1 (inside a loopback-only network namespace)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvplug.testing import tier_context
from kvplug_mooncake import MooncakeTier
from kvplug_mooncake.testing import MooncakeCluster


@pytest.fixture(scope="session")
def mooncake_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeCluster]:
    with MooncakeCluster(tmp_path_factory.mktemp("mooncake")) as cluster:
        yield cluster


@pytest.fixture
def make_mooncake_tier(mooncake_cluster: MooncakeCluster) -> Iterator[Callable[..., MooncakeTier]]:
    made: list[MooncakeTier] = []

    def make(cluster: MooncakeCluster | None = None, **options: Any) -> MooncakeTier:
        cluster = cluster or mooncake_cluster
        config = MooncakeTier.Config(**{**cluster.tier_options, **options})
        tier = MooncakeTier(config, tier_context())
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
