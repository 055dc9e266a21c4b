"""kvplug plugin: storage tier ``valkey`` (a shared cache on Valkey or Redis, standalone or cluster)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvplug

if TYPE_CHECKING:
    from kvplug_valkey.config import ValkeyTierConfig
    from kvplug_valkey.tier import ValkeyTier

#: Exported name -> its module, imported on first use: registering the plugin (every
#: ``kvplug`` command does) imports none of them, nor what they import (torch).
_LAZY = {
    "ValkeyTierConfig": "kvplug_valkey.config",
    "ValkeyTier": "kvplug_valkey.tier",
}

__all__ = ["ValkeyTier", "ValkeyTierConfig"]


__getattr__ = kvplug.lazy_exports(__name__, _LAZY)


@kvplug.hookimpl
def kvplug_storage_tiers() -> list[type]:
    from kvplug_valkey.tier import ValkeyTier

    return [ValkeyTier]
