"""``LayerwiseRetrieve``: chunks a ``CacheEngine`` fetched and verified, written into
its paged cache layer by layer (or all at once), and where the retrieve's time went.

Kept apart from :mod:`kvplug.core.engine.cache_engine`, which builds one per retrieve; what it uses
of its engine is declared by :class:`~kvplug.core.engine.parts.EngineParts` (this module does not
import the engine).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvplug.core.connector import LayerCache
from kvplug.core.engine.parts import EngineParts
from kvplug.core.events import KVEvent
from kvplug.core.keys import ChunkKey
from kvplug.errors import ConnectorError


@dataclass
class RetrieveTimings:
    """Where one retrieve's time went, in seconds: tier reads, decoding and verifying, writing into the cache."""

    fetch_s: float = 0.0
    verify_s: float = 0.0
    write_s: float = 0.0


class LayerwiseRetrieve(Iterator[int]):
    """Chunks fetched and verified; each ``next()`` writes one layer, yielding its index.

    ``loaded_mask`` and ``num_loaded_tokens`` are known before the first layer is
    written, so an engine can plan its compute while layers stream in. ``timings``
    says where the time went (the write time grows as layers are written).
    """

    def __init__(
        self,
        engine: EngineParts,
        num_tokens: int,
        first: int,
        kv_caches: Sequence[LayerCache],
        slots: torch.Tensor,
        chunks: list[tuple[ChunkKey, torch.Tensor]],
        started: float,
        timings: RetrieveTimings,
    ) -> None:
        self.timings = timings
        self._engine = engine
        self._kv_caches = kv_caches
        self._slots = slots
        self._chunks = chunks
        self._started = started
        self._next_layer = 0
        self.loaded_mask = torch.zeros(num_tokens, dtype=torch.bool)
        self._spans = [(max(chunk.start, first), chunk.end, chunk.start) for chunk, _ in chunks]
        self._plans = engine.connector.plan_many(slots, [(start, end) for start, end, _ in self._spans])
        for start, end, _ in self._spans:
            self.loaded_mask[start:end] = True
        self.num_loaded_tokens = int(self.loaded_mask.sum())

    def __next__(self) -> int:
        layer = self._next_layer
        if layer >= self._engine.layout.num_layers:
            raise StopIteration
        self._write(range(layer, layer + 1))
        return layer

    def write_remaining(self) -> None:
        """Write every layer not written yet."""
        if self._next_layer < self._engine.layout.num_layers:
            self._write(range(self._next_layer, self._engine.layout.num_layers))

    def _write(self, layers: range) -> None:
        engine = self._engine
        started = time.perf_counter()
        try:
            # Chunks hold different slots and layers are different tensors: the writes
            # touch disjoint memory and run on the copy threads, as gathers do.
            sources = [
                tensor[:, :, start - chunk_start :]
                for (start, _, chunk_start), (_, tensor) in zip(self._spans, self._chunks)
            ]
            copies = engine.connector.scatter_copies(
                self._kv_caches, layers, self._plans, sources, engine._copies.threads
            )
            engine._run_copies(self._kv_caches, copies)
        except ConnectorError as exc:
            # Some layers are written and this one maybe in part: report nothing as
            # loaded, so the engine recomputes (and overwrites) all of it.
            self._engine._count_connector_error("retrieve", exc)
            self._nothing_loaded()
        except Exception:
            # Raised to the caller (bad slots, a device error): a caller that goes on must
            # not read the mask as written tokens either.
            self._nothing_loaded()
            raise
        self.timings.write_s += time.perf_counter() - started
        self._next_layer = layers.stop
        if self._next_layer == engine.layout.num_layers:
            self._finish()

    def _nothing_loaded(self) -> None:
        self._plans, self._spans, self._chunks = [], [], []
        self.loaded_mask.zero_()
        self.num_loaded_tokens = 0

    def _finish(self) -> None:
        engine = self._engine
        try:
            engine.connector.synchronize()
        except ConnectorError as exc:
            engine._count_connector_error("retrieve", exc)
            self.loaded_mask.zero_()
            self.num_loaded_tokens = 0
            self._chunks = []
        engine.metrics.loaded_tokens.inc(self.num_loaded_tokens)
        engine.metrics.retrieve_seconds.observe(time.perf_counter() - self._started)
        if self._chunks:
            engine._events.emit(
                KVEvent(
                    "loaded",
                    tuple(c.key for c, _ in self._chunks),
                    token_counts=tuple(c.num_tokens for c, _ in self._chunks),
                )
            )
