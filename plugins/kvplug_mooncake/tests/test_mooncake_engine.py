"""The README's chain, ``[cpu, mooncake]``, under a CacheEngine on a real Mooncake cluster: exact KV
round trips, and a second engine (empty cpu tier) hits from Mooncake and promotes to cpu
(kvplug's contract suite, as the s3 and valkey tiers run it)."""

from __future__ import annotations

from typing import Any

import pytest

from kvplug.testing import TierRoundTripContract
from kvplug_mooncake.testing import MooncakeCluster


class TestMooncakeRoundTrip(TierRoundTripContract):
    plugins = "cpu,mooncake"

    @pytest.fixture
    def tier_entry(self, mooncake_cluster: MooncakeCluster) -> dict[str, Any]:
        return {"type": "mooncake", **mooncake_cluster.tier_options}
