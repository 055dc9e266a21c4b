"""kvplug plugin: storage tiers ``disk`` and ``shm``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvplug

if TYPE_CHECKING:
    from kvplug_disk.config import DiskTierConfig, ShmTierConfig
    from kvplug_disk.shm import ShmTier
    from kvplug_disk.tier import DiskTier
    from kvplug_disk.verify import VerifyReport, verify_folder

#: Exported name -> its module, imported on first use: registering the plugin (every
#: ``kvplug`` command does) imports none of them, nor what they import (torch).
_LAZY = {
    "DiskTierConfig": "kvplug_disk.config",
    "ShmTierConfig": "kvplug_disk.config",
    "ShmTier": "kvplug_disk.shm",
    "DiskTier": "kvplug_disk.tier",
    "VerifyReport": "kvplug_disk.verify",
    "verify_folder": "kvplug_disk.verify",
}

__all__ = ["DiskTier", "DiskTierConfig", "ShmTier", "ShmTierConfig", "VerifyReport", "verify_folder"]


__getattr__ = kvplug.lazy_exports(__name__, _LAZY)


@kvplug.hookimpl
def kvplug_storage_tiers() -> list[type]:
    from kvplug_disk.shm import ShmTier
    from kvplug_disk.tier import DiskTier

    return [DiskTier, ShmTier]
