"""One chunk's copies through a connector's public path, for connector tests and benchmarks.

``CacheEngine`` never copies a single chunk on its own: it plans every chunk of a call
and runs the connector's ``gather_copies``/``scatter_copies``. These helpers take that
same path for one chunk and every layer, so a test checks what the engine runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # kvplug.testing imports no torch: tier plugins' tests use it too
    import torch

    from kvplug.core.connector import KVConnector, LayerCache


def gather_chunk(
    connector: KVConnector, kv_caches: Sequence[LayerCache], slots: torch.Tensor, out: torch.Tensor
) -> None:
    """Copy the KV of ``slots`` in every layer of ``kv_caches`` into ``out``
    (``[num_layers, num_kv, len(slots), width]``). A device connector may still be
    copying when this returns: call its ``synchronize()`` before reading ``out``."""
    copies = connector.gather_copies(kv_caches, range(len(kv_caches)), [connector.plan(slots)], [out], 1)
    for copy in copies:
        copy()


def scatter_chunk(
    connector: KVConnector, kv_caches: Sequence[LayerCache], slots: torch.Tensor, src: torch.Tensor
) -> None:
    """Write ``src`` (laid out as :func:`gather_chunk` fills it) into ``slots`` of every layer."""
    copies = connector.scatter_copies(kv_caches, range(len(kv_caches)), [connector.plan(slots)], [src], 1)
    for copy in copies:
        copy()
