"""kvplug plugin: KV connector ``cuda`` (Triton paged-copy kernels, pinned staging, copy stream)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvplug

if TYPE_CHECKING:
    from kvplug_cuda.connector import CudaConnector, CudaConnectorConfig
    from kvplug_cuda.pinned_pool import PinnedBuffer, PinnedPool, PoolStats

#: Exported name -> its module, imported on first use: registering the plugin (every
#: ``kvplug`` command does) imports none of them, nor what they import (torch).
_LAZY = {
    "CudaConnector": "kvplug_cuda.connector",
    "CudaConnectorConfig": "kvplug_cuda.connector",
    "PinnedBuffer": "kvplug_cuda.pinned_pool",
    "PinnedPool": "kvplug_cuda.pinned_pool",
    "PoolStats": "kvplug_cuda.pinned_pool",
}

__all__ = ["CudaConnector", "CudaConnectorConfig", "PinnedBuffer", "PinnedPool", "PoolStats"]


__getattr__ = kvplug.lazy_exports(__name__, _LAZY)


@kvplug.hookimpl
def kvplug_kv_connectors() -> list[type]:
    from kvplug_cuda.connector import CudaConnector

    return [CudaConnector]
