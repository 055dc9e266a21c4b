"""kvplug plugin: KV connector ``cuda`` (Triton paged-copy kernels, pinned staging, copy stream)."""

from __future__ import annotations

import kvplug
from kvplug_cuda.connector import CudaConnector, CudaConnectorConfig
from kvplug_cuda.pinned_pool import PinnedBuffer, PinnedPool, PoolStats

__all__ = ["CudaConnector", "CudaConnectorConfig", "PinnedBuffer", "PinnedPool", "PoolStats"]


@kvplug.hookimpl
def kvplug_kv_connectors() -> list[type]:
    return [CudaConnector]
