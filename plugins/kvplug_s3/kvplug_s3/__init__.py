"""kvplug plugin: storage tier ``s3`` (S3 and any writable fsspec URL)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvplug

if TYPE_CHECKING:
    from kvplug_s3.config import S3TierConfig
    from kvplug_s3.tier import S3Tier

#: Exported name -> its module, imported on first use: registering the plugin (every
#: ``kvplug`` command does) imports none of them, nor what they import (torch).
_LAZY = {
    "S3TierConfig": "kvplug_s3.config",
    "S3Tier": "kvplug_s3.tier",
}

__all__ = ["S3Tier", "S3TierConfig"]


__getattr__ = kvplug.lazy_exports(__name__, _LAZY)


@kvplug.hookimpl
def kvplug_storage_tiers() -> list[type]:
    from kvplug_s3.tier import S3Tier

    return [S3Tier]
