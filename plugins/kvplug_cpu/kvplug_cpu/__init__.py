"""kvplug plugin: storage tier ``cpu``."""

from __future__ import annotations

import kvplug
from kvplug_cpu.tier import CPUTier, CPUTierConfig

__all__ = ["CPUTier", "CPUTierConfig"]


@kvplug.hookimpl
def kvplug_storage_tiers() -> list[type]:
    return [CPUTier]
