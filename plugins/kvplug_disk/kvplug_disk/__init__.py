"""kvplug plugin: storage tiers ``disk`` and ``shm``."""

from __future__ import annotations

import kvplug
from kvplug_disk.config import DiskTierConfig, ShmTierConfig
from kvplug_disk.shm import ShmTier
from kvplug_disk.tier import DiskTier
from kvplug_disk.verify import VerifyReport, verify_folder

__all__ = ["DiskTier", "DiskTierConfig", "ShmTier", "ShmTierConfig", "VerifyReport", "verify_folder"]


@kvplug.hookimpl
def kvplug_storage_tiers() -> list[type]:
    return [DiskTier, ShmTier]
