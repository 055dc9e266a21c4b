"""Tier ``s3`` against the storage contract: real S3 servers (moto, SeaweedFS), memory:// and file://."""

from __future__ import annotations

import uuid

import pytest

from kvplug.testing import StorageTierContract, tier_context
from kvplug_s3 import S3Tier
from kvplug_s3.testing import make_s3_tier


def _budget(max_bytes: int | None) -> dict:
    return {} if max_bytes is None else {"max_bytes": max_bytes}


class TestS3TierOnMoto(StorageTierContract):
    # large_value_bytes stays at the contract's 64 MiB: moto takes it in well under a second.
    # Every step is HTTP round trips to moto: fewer random sequences (memory:// and file:// run the full count).
    stateful_examples = 8

    @pytest.fixture
    def make_tier(self, moto_s3):
        return lambda max_bytes=None: make_s3_tier(moto_s3.endpoint, **_budget(max_bytes))


class TestS3TierOnSeaweedFS(StorageTierContract):
    # A real S3 implementation (master, volume and filer behind the S3 gateway).
    # Each step is HTTP round trips: fewer random sequences, as on moto.
    stateful_examples = 6

    @pytest.fixture
    def make_tier(self, seaweed_s3):
        return lambda max_bytes=None: make_s3_tier(seaweed_s3.endpoint, **_budget(max_bytes))


class TestS3TierOnMemoryURL(StorageTierContract):
    @pytest.fixture
    def make_tier(self):
        # memory:// is one store per process: a fresh name per tier keeps tests apart.
        def make(max_bytes=None):
            url = f"memory://kvplug-contract-{uuid.uuid4().hex[:12]}"
            return S3Tier(S3Tier.Config(url=url, **_budget(max_bytes)), tier_context())

        return make


class TestS3TierOnFileURL(StorageTierContract):
    @pytest.fixture
    def make_tier(self, tmp_path):
        def make(max_bytes=None):
            url = f"file://{tmp_path}/{uuid.uuid4().hex[:12]}"
            return S3Tier(S3Tier.Config(url=url, **_budget(max_bytes)), tier_context())

        return make
