"""A CacheEngine with tiers [cpu, s3] on a real S3 server: exact KV round trips, and a
second engine (empty cpu tier) hits from S3 and promotes to cpu (kvplug's contract suite)."""

from __future__ import annotations

from typing import Any

import pytest

from kvplug.testing import TierRoundTripContract
from kvplug_s3.testing import MotoS3, s3_options


class TestS3RoundTrip(TierRoundTripContract):
    plugins = "cpu,s3"

    @pytest.fixture
    def tier_entry(self, moto_s3: MotoS3) -> dict[str, Any]:
        return {"type": "s3", **s3_options(moto_s3.endpoint)}
