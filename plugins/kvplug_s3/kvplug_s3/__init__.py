"""kvplug plugin: storage tier ``s3`` (S3 and any writable fsspec URL)."""

from __future__ import annotations

import kvplug
from kvplug_s3.config import S3TierConfig
from kvplug_s3.tier import S3Tier

__all__ = ["S3Tier", "S3TierConfig"]


@kvplug.hookimpl
def kvplug_storage_tiers() -> list[type]:
    return [S3Tier]
