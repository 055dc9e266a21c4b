"""kvplug plugin: storage tier ``valkey`` (a shared cache on Valkey or Redis, standalone or cluster)."""

from __future__ import annotations

import kvplug
from kvplug_valkey.config import ValkeyTierConfig
from kvplug_valkey.tier import ValkeyTier

__all__ = ["ValkeyTier", "ValkeyTierConfig"]


@kvplug.hookimpl
def kvplug_storage_tiers() -> list[type]:
    return [ValkeyTier]
