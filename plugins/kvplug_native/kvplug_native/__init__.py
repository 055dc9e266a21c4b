"""kvplug plugin: KV connector ``native`` (run tables of a batch copied in C, streaming stores)."""

from __future__ import annotations

import kvplug
from kvplug_native.connector import NativeConnector, NativeConnectorConfig, NativePlan

__all__ = ["NativeConnector", "NativeConnectorConfig", "NativePlan"]


@kvplug.hookimpl
def kvplug_kv_connectors() -> list[type]:
    return [NativeConnector]
