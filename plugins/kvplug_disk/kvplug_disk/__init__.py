"""kvplug plugin: storage tier ``disk``."""

from __future__ import annotations

import kvplug
from kvplug_disk.config import DiskTierConfig
from kvplug_disk.tier import DiskTier
from kvplug_disk.verify import VerifyReport, verify_folder

__all__ = ["DiskTier", "DiskTierConfig", "VerifyReport", "verify_folder"]


@kvplug.hookimpl
def kvplug_storage_tiers() -> list[type]:
    return [DiskTier]
