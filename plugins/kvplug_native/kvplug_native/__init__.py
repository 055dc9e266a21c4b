"""kvplug plugin: KV connector ``native`` (run tables of a batch copied in C, streaming stores)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvplug

if TYPE_CHECKING:
    from kvplug_native.connector import NativeConnector, NativeConnectorConfig, NativePlan

#: Exported name -> its module, imported on first use: registering the plugin (every
#: ``kvplug`` command does) imports none of them, nor what they import (torch).
_LAZY = {
    "NativeConnector": "kvplug_native.connector",
    "NativeConnectorConfig": "kvplug_native.connector",
    "NativePlan": "kvplug_native.connector",
}

__all__ = ["NativeConnector", "NativeConnectorConfig", "NativePlan"]


__getattr__ = kvplug.lazy_exports(__name__, _LAZY)


@kvplug.hookimpl
def kvplug_kv_connectors() -> list[type]:
    from kvplug_native.connector import NativeConnector

    return [NativeConnector]
