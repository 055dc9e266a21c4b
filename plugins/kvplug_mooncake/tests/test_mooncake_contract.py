"""Tier ``mooncake`` against the storage contract, on a real mooncake_master + storage process."""

from __future__ import annotations

import uuid

import pytest

from kvplug.testing import StorageTierContract


class TestMooncakeTier(StorageTierContract):
    # Every step is client calls to real processes on 2 shared cores: fewer random sequences.
    stateful_examples = 8

    @pytest.fixture
    def make_tier(self, mooncake_cluster):
        from kvplug.testing import tier_context
        from kvplug_mooncake import MooncakeTier

        def make(max_bytes=None):
            # A fresh key prefix per tier: the store outlives each tier, as a shared store does.
            options = {**mooncake_cluster.tier_options, "key_prefix": f"t{uuid.uuid4().hex[:12]}/"}
            if max_bytes is not None:
                options["max_bytes"] = max_bytes
            return MooncakeTier(MooncakeTier.Config(**options), tier_context())

        return make
