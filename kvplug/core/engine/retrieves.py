"""The load path of :class:`~kvplug.CacheEngine`: fetch and verify the records of a
prompt's cached prefix (whole chunks, another TP size's head groups, a block-granular
tail), then scatter them into the paged KV cache, at once or layer by layer
(:class:`~kvplug.core.engine.layerwise_retrieve.LayerwiseRetrieve`).

:class:`EngineRetrieves` is a base class of ``CacheEngine``, as
:class:`~kvplug.core.engine.stores.EngineStores` is, and reads the engine's parts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvplug.core.connector import LayerCache
from kvplug.core.engine.head_shards import HeadRecords, OtherSplit
from kvplug.core.engine.layerwise_retrieve import LayerwiseRetrieve, RetrieveTimings
from kvplug.core.engine.parts import EngineParts
from kvplug.core.engine.split_lookup import other_split_holding
from kvplug.core.engine.tails import HeldTail
from kvplug.core.keys import ChunkKey, RequestInfo

logger = logging.getLogger("kvplug.engine")


class EngineRetrieves(EngineParts):
    """``retrieve``/``retrieve_layerwise`` of a :class:`~kvplug.CacheEngine`."""

    if TYPE_CHECKING:

        def _located_tail(
            self, tokens: Sequence[int] | torch.Tensor, keys: Sequence[ChunkKey], held: int, request: RequestInfo | None
        ) -> HeldTail | None: ...

    # --- retrieve -------------------------------------------------------------------

    def retrieve(
        self,
        tokens: Sequence[int] | torch.Tensor,
        kv_caches: Sequence[LayerCache],
        slots: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        request: RequestInfo | None = None,
    ) -> torch.Tensor:
        """Load the cached prefix of ``tokens`` into ``slots``; returns a bool mask of
        the tokens written. ``mask`` ``False`` entries (a prefix) are already in the
        engine and are not written."""
        loading = self.retrieve_layerwise(tokens, kv_caches, slots, mask, request=request)
        loading.write_remaining()
        return loading.loaded_mask

    def retrieve_layerwise(
        self,
        tokens: Sequence[int] | torch.Tensor,
        kv_caches: Sequence[LayerCache],
        slots: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        request: RequestInfo | None = None,
        keys: Sequence[ChunkKey] | None = None,
    ) -> LayerwiseRetrieve:
        """Fetch and verify the cached chunks now; iterate to write them layer by layer.
        ``keys``: :meth:`chunk_keys` of ``tokens`` and ``request``, when the caller has them."""
        self._check_open()
        first = self.layout.check_call(len(tokens), kv_caches, slots, mask)
        started = time.perf_counter()
        timings = RetrieveTimings()
        chunks: list[tuple[ChunkKey, torch.Tensor]] = []
        try:
            if self.layout.whole_blocks_only:  # a block is loaded whole or not at all
                first = -(-first // self.layout.block_size) * self.layout.block_size
            every = self.chunk_keys(tokens, request) if keys is None else keys
            wanted = [k for k in every if k.end > first]
            keys = [k for k in wanted if self._copyable(max(k.start, first), k.end)]
            # Verified (a bad chunk ends the prefix and is removed); only those promoted.
            split: HeadRecords | OtherSplit = self.records
            loaded = self.chunk_store.load_prefix(
                self.record_keys(keys, request),
                [split.record_shape(k.num_tokens) for k in keys for _ in range(split.count)],
                self.layout.dtype,
            )
            names = [k.key for k in keys]
            holds_none = len(loaded.tensors) < split.count
            other = other_split_holding(self.records, self.chain, names, request) if holds_none else None
            if other is not None:  # another TP size's writer: its records of these heads
                split = other
                loaded = self.chunk_store.load_prefix(
                    other.record_keys(names, request),
                    [other.record_shape(k.num_tokens) for k in keys for _ in range(other.count)],
                    self.layout.dtype,
                )
            timings.fetch_s, timings.verify_s = loaded.fetch_s, loaded.verify_s
            chunks = list(zip(keys, split.joined(loaded.tensors, [k.num_tokens for k in keys])))
            # as locate (any split's tail, after any split's chunks), also past a packed layout's uncopyable last chunk
            if self.config.block_granular_hits and wanted[len(chunks) :]:
                chunks += self._loaded_tail(tokens, every, wanted[len(chunks)].index, first, request)
        except Exception:
            logger.exception("retrieve: fetching chunks failed; treated as a miss")
        return LayerwiseRetrieve(self, len(tokens), first, kv_caches, slots.to(torch.long), chunks, started, timings)

    def _loaded_tail(
        self,
        tokens: Sequence[int] | torch.Tensor,
        keys: Sequence[ChunkKey],
        held: int,
        first: int,
        request: RequestInfo | None,
    ) -> list[tuple[ChunkKey, torch.Tensor]]:
        """The longest stored tail of chunk ``held``, loaded: what a lookup adds to the whole chunks."""
        tail = self._located_tail(tokens, keys, held, request)
        if tail is None or tail.key.end <= first or not self._copyable(max(tail.key.start, first), tail.key.end):
            return []
        key, split = tail.key, tail.split  # the records of whichever TP size's writer stored it
        loaded = self.chunk_store.load_prefix(
            split.record_keys([key.key], request), [split.record_shape(key.num_tokens)] * split.count, self.layout.dtype
        )
        return list(zip([key], split.joined(loaded.tensors, [key.num_tokens])))
