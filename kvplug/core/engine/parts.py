"""What the store and load paths of :class:`~kvplug.CacheEngine` read of the engine, and the
copy helpers both use: :class:`EngineParts`, the base of
:class:`~kvplug.core.engine.stores.EngineStores` and
:class:`~kvplug.core.engine.retrieves.EngineRetrieves`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.config.model import KVPlugConfig
from kvplug.core.connector import KVConnector, LayerCache
from kvplug.core.engine.chunk_store import ChunkStore
from kvplug.core.engine.head_shards import HeadRecords
from kvplug.core.engine.parallel_copies import ParallelCopies
from kvplug.core.events import EventListeners
from kvplug.core.keys import ChunkKey, RequestInfo
from kvplug.core.layouts import KVLayout
from kvplug.core.metrics import EngineMetrics
from kvplug.errors import ConnectorError

logger = logging.getLogger("kvplug.engine")


class EngineParts:
    """The parts of a :class:`~kvplug.CacheEngine` its store and load paths share (set by
    its constructor), and the copy helpers of both."""

    config: KVPlugConfig
    layout: KVLayout
    metrics: EngineMetrics
    connector: KVConnector
    chunk_store: ChunkStore
    chain: TierChain
    records: HeadRecords
    _copies: ParallelCopies
    _events: EventListeners

    if TYPE_CHECKING:

        def chunk_keys(
            self,
            tokens: Sequence[int] | torch.Tensor,
            request: RequestInfo | None = None,
            *,
            include_partial: bool = True,
        ) -> list[ChunkKey]: ...

        def record_keys(self, keys: Sequence[ChunkKey], request: RequestInfo | None = None) -> list[str]: ...

        def _check_open(self) -> None: ...

    def _run_copies(self, kv_caches: Sequence[LayerCache], copies: Sequence[Callable[[], None]]) -> None:
        """Run copies out of or into the cache, on the copy threads when it is in host memory."""
        on_host = bool(kv_caches) and self.layout.layer_tensors(kv_caches[0])[0].device.type == "cpu"
        self._copies.run(copies, parallel=on_host)

    def _count_connector_error(self, operation: str, exc: ConnectorError) -> None:
        self.metrics.load_errors.labels(type(exc).__name__).inc()
        logger.warning("%s: connector %s failed (%s); treated as a miss", operation, self.connector.name, exc)

    def _copyable(self, start: int, end: int) -> bool:
        """Whether tokens ``[start, end)`` can be copied in this layout."""
        size = self.layout.block_size
        return not self.layout.whole_blocks_only or (start % size == 0 and end % size == 0)
