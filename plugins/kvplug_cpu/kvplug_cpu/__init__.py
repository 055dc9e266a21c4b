"""kvplug plugin: storage tier ``cpu``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvplug

if TYPE_CHECKING:
    from kvplug_cpu.tier import CPUTier, CPUTierConfig

#: Exported name -> its module, imported on first use: registering the plugin (every
#: ``kvplug`` command does) imports none of them, nor what they import (torch).
_LAZY = {
    "CPUTier": "kvplug_cpu.tier",
    "CPUTierConfig": "kvplug_cpu.tier",
}

__all__ = ["CPUTier", "CPUTierConfig"]


__getattr__ = kvplug.lazy_exports(__name__, _LAZY)


@kvplug.hookimpl
def kvplug_storage_tiers() -> list[type]:
    from kvplug_cpu.tier import CPUTier

    return [CPUTier]
