"""Tier ``valkey`` against the storage contract, on a real standalone server and a real 3-node cluster."""

from __future__ import annotations

import pytest
from valkey_helpers import make_valkey_tier

from kvplug.testing import StorageTierContract


def _budget(max_bytes: int | None) -> dict:
    return {} if max_bytes is None else {"max_bytes": max_bytes}


class TestValkeyStandalone(StorageTierContract):
    # The 64 MiB value goes through in one SET; the default 0.5 s deadline is for chunks of a few MiB.
    large_value_bytes = 64 * 1024 * 1024
    stateful_examples = 10

    @pytest.fixture
    def make_tier(self, valkey_server):
        return lambda max_bytes=None: make_valkey_tier(valkey_server.url, request_timeout_s=5.0, **_budget(max_bytes))


class TestValkeyCluster(StorageTierContract):
    large_value_bytes = 16 * 1024 * 1024
    stateful_examples = 8

    @pytest.fixture
    def make_tier(self, valkey_cluster):
        # cluster: unset, so the tier detects it (INFO cluster) as it would in production.
        return lambda max_bytes=None: make_valkey_tier(valkey_cluster.url, request_timeout_s=5.0, **_budget(max_bytes))
