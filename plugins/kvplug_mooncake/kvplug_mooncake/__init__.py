"""kvplug plugin: storage tier ``mooncake`` (Mooncake Store)."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module), name)


@kvplug.hookimpl
def kvplug_storage_tiers() -> list[type]:
    from kvplug_mooncake.tier import MooncakeTier

    return [MooncakeTier]
