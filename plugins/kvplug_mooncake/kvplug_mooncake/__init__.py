"""kvplug plugin: storage tier ``mooncake`` (Mooncake Store)."""

from __future__ import annotations

import kvplug
from kvplug_mooncake.config import MooncakeTierConfig
from kvplug_mooncake.tier import MooncakeTier

__all__ = ["MooncakeTier", "MooncakeTierConfig"]


@kvplug.hookimpl
def kvplug_storage_tiers() -> list[type]:
    return [MooncakeTier]
