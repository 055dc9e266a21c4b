"""kvplug plugin: storage tier ``mooncake`` (Mooncake Store)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvplug

if TYPE_CHECKING:
    from kvplug_mooncake.config import MooncakeTierConfig
    from kvplug_mooncake.tier import MooncakeTier

#: Exported name -> its module, imported on first use: registering the plugin (every
#: ``kvplug`` command does) imports none of them, nor what they import (torch).
_LAZY = {
    "MooncakeTierConfig": "kvplug_mooncake.config",
    "MooncakeTier": "kvplug_mooncake.tier",
}

__all__ = ["MooncakeTier", "MooncakeTierConfig"]


__getattr__ = kvplug.lazy_exports(__name__, _LAZY)


@kvplug.hookimpl
def kvplug_storage_tiers() -> list[type]:
    from kvplug_mooncake.tier import MooncakeTier

    return [MooncakeTier]
