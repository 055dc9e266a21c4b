"""kvplug plugin: KV connector ``native`` (run tables of a batch copied in C, streaming stores)."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module), name)


@kvplug.hookimpl
def kvplug_kv_connectors() -> list[type]:
    from kvplug_native.connector import NativeConnector

    return [NativeConnector]
