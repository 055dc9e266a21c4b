"""The store path of :class:`~kvplug.CacheEngine`: gather chunks out of the paged KV
cache into frames (the copy the caller waits for), then seal and write them to the
tiers, on the store worker in ``store.queue.mode: async``.

Kept apart from the engine's lookups and loads; :class:`EngineStores` is a base class
of ``CacheEngine`` and reads the engine's parts (layout, chain, records, connector).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvplug.core.background import BackgroundWorker
from kvplug.core.chain.write_queue import Items
from kvplug.core.config.model import KVPlugConfig
from kvplug.core.connector import LayerCache
from kvplug.core.engine.frame_pool import FramePool
from kvplug.core.engine.parts import EngineParts
from kvplug.core.engine.tails import tail_cut
from kvplug.core.events import KVEvent
from kvplug.core.keys import ChunkKey, Fingerprint, KeyBuilder, RequestInfo
from kvplug.core.pins import pin_for_request
from kvplug.core.records.manifest import ManifestWriter
from kvplug.errors import ConnectorError

logger = logging.getLogger("kvplug.engine")


@dataclass
class StoreBatch:
    """What the store worker writes for one store call."""

    #: (key, filled but not yet sealed frame, tokens) per record.
    chunks: list[tuple[str, Any, int]]
    #: The fingerprint manifests due (:meth:`ManifestWriter.due`): written with the chunks,
    #: never on the store call's thread, which must not wait on a tier.
    manifests: Items = field(default_factory=list)

    def nbytes(self) -> int:
        return sum(memoryview(frame).nbytes for _, frame, _ in self.chunks)


class QueuedKeys:
    """The keys of store batches queued for the store thread, not handed to the tiers yet
    (counted: two batches may hold one key)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._counts[key] = self._counts.get(key, 0) + 1

    def done(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                left = self._counts.get(key, 0) - 1
                if left > 0:
                    self._counts[key] = left
                else:
                    self._counts.pop(key, None)

    def holds(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._counts for key in keys]


class EngineStores(EngineParts):
    """``store``/``store_layerwise`` of a :class:`~kvplug.CacheEngine`."""

    fingerprint: Fingerprint
    key_builder: KeyBuilder
    frame_pool: FramePool
    _manifests: ManifestWriter
    _store_worker: BackgroundWorker[StoreBatch] | None
    _queued_keys: QueuedKeys
    #: A store of this engine wrote (or may have written) a partial last chunk, by its request's
    #: own ``save_unfull_chunk``: inline lookups can no longer assume none is stored.
    _stored_partial_chunks: bool = False

    if TYPE_CHECKING:

        def _key_prefix(self, request: RequestInfo) -> str: ...

    # --- store ----------------------------------------------------------------------

    def store(
        self,
        tokens: Sequence[int] | torch.Tensor,
        kv_caches: Sequence[LayerCache],
        slots: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        request: RequestInfo | None = None,
    ) -> int:
        """Store the chunks of ``tokens`` whose KV sits at ``slots``; returns tokens queued.

        ``mask`` (bool per token) marks the tokens this call is for; its ``False``
        entries must form a prefix (tokens stored earlier). A chunk that straddles
        that prefix's end is gathered whole, so the slots of its masked tokens must
        still hold their KV: a mask does not make unreadable slots safe. The copy out
        of ``kv_caches`` is done before returning; writing to tiers may not be.
        """
        layers = self._store(tokens, kv_caches, slots, mask, request, layers_per_step=self.layout.num_layers)
        while True:
            try:
                next(layers)
            except StopIteration as done:
                return int(done.value or 0)

    def store_layerwise(
        self,
        tokens: Sequence[int] | torch.Tensor,
        kv_caches: Sequence[LayerCache],
        slots: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        request: RequestInfo | None = None,
    ) -> Generator[int, None, int]:
        """Generator form of :meth:`store`: each ``next()`` copies one more layer.

        Call ``next()`` once a layer's KV is final; it yields that layer's index.
        After the last layer the chunks are sealed and handed to the tiers; the
        generator returns the number of tokens queued. Arguments are checked now.
        """
        return self._store(tokens, kv_caches, slots, mask, request, layers_per_step=1)

    def _store(
        self,
        tokens: Sequence[int] | torch.Tensor,
        kv_caches: Sequence[LayerCache],
        slots: torch.Tensor,
        mask: torch.Tensor | None,
        request: RequestInfo | None,
        *,
        layers_per_step: int,
    ) -> Generator[int, None, int]:
        self._check_open()
        first = self.layout.check_call(len(tokens), kv_caches, slots, mask)
        config = self._request_config(request)
        if config.save_unfull_chunk and not config.skip_save:
            self._stored_partial_chunks = True
        if config.pin_request and not config.skip_save:  # first: a tier pins a wanted chunk as it stores it
            pin_for_request(self, tokens, request, config)
        # Per chunk: its records (key, frame, payload), and the tensor its KV is gathered into.
        todo: list[tuple[ChunkKey, list[tuple[str, Any, torch.Tensor]], torch.Tensor]] = []
        # A replica (not the writer of its heads) keeps copies only in process-private tiers.
        if not config.skip_save and (self.records.writer or any(t.trusted_reads for t in self.chain.tiers)):
            try:
                keys = [
                    k
                    for k in self.stored_keys(tokens, request, config)
                    if k.end > first and self._copyable(k.start, k.end)
                ]
                record_keys, count = self.record_keys(keys, request), self.records.count
                stored = self.chain.contains_any(record_keys, sync_tiers_only=True) if keys else []
                for index, chunk in enumerate(keys):
                    if all(stored[index * count : (index + 1) * count]):
                        continue
                    shape = self.records.record_shape(chunk.num_tokens)
                    records = [
                        (key, *self.chunk_store.allocate(shape, self.layout.dtype, self.frame_pool.new_buffer))
                        for key in record_keys[index * count : (index + 1) * count]
                    ]
                    whole = self.layout.chunk_shape(chunk.num_tokens)
                    gathered = records[0][2] if count == 1 else torch.empty(whole, dtype=self.layout.dtype)
                    todo.append((chunk, records, gathered))
            except Exception:
                logger.exception("store: preparing chunks failed; nothing stored")
                todo = []
        return self._store_layers(kv_caches, slots.to(torch.long), todo, request, layers_per_step)

    def stored_keys(
        self,
        tokens: Sequence[int] | torch.Tensor,
        request: RequestInfo | None,
        config: KVPlugConfig,
        *,
        include_partial: bool | None = None,
    ) -> list[ChunkKey]:
        """The chunks a store of ``tokens`` writes (and a pin of them pins): the whole ones, the
        partial last one with ``save_unfull_chunk`` (``include_partial``: whatever that says), and
        the tail cut at the last block end with ``block_granular_hits`` (:mod:`kvplug.core.engine.tails`)."""
        prefix, tail = self.stored_prefix_and_tail(tokens, request, config, include_partial=include_partial)
        return prefix + tail

    def stored_prefix_and_tail(
        self,
        tokens: Sequence[int] | torch.Tensor,
        request: RequestInfo | None,
        config: KVPlugConfig,
        *,
        include_partial: bool | None = None,
    ) -> tuple[list[ChunkKey], list[ChunkKey]]:
        """:meth:`stored_keys` in two: the prompt's chunks (a load reads them as one prefix) and
        the block-granular tail after them (none, or one key)."""
        partial = config.save_unfull_chunk if include_partial is None else include_partial
        keys = self.chunk_keys(tokens, request, include_partial=partial)
        cut = tail_cut(len(tokens), config.chunk_size, self.layout.block_size) if config.block_granular_hits else 0
        if not cut or (keys and keys[-1].end == cut):
            return keys, []
        whole = cut // config.chunk_size  # the whole chunks before the tail: the first keys
        return keys, self._tail_keys(
            tokens, keys[whole - 1] if whole else None, [cut - whole * config.chunk_size], request
        )

    def _tail_keys(
        self,
        tokens: Sequence[int] | torch.Tensor,
        after: ChunkKey | None,
        lengths: Sequence[int],
        request: RequestInfo | None,
    ) -> list[ChunkKey]:
        """The keys of the chunk after ``after`` (``None``: the first) cut at each of ``lengths``
        tokens (:mod:`kvplug.core.engine.tails`), the prefix not hashed again."""
        request = request or RequestInfo()
        return self.key_builder.tail_keys(
            tokens, self._key_prefix(request), after, lengths, extra_keys=request.extra_keys
        )

    def _store_layers(
        self,
        kv_caches: Sequence[LayerCache],
        slots: torch.Tensor,
        todo: list[tuple[ChunkKey, list[tuple[str, Any, torch.Tensor]], torch.Tensor]],
        request: RequestInfo | None,
        layers_per_step: int,
    ) -> Generator[int, None, int]:
        """Copy ``layers_per_step`` layers of every chunk per ``next()`` (one pass of parallel copies)."""
        started = time.perf_counter()
        plans = self.connector.plan_many(slots, [(chunk.start, chunk.end) for chunk, _, _ in todo])
        for first in range(0, self.layout.num_layers, layers_per_step):
            layers = range(first, min(first + layers_per_step, self.layout.num_layers))
            try:
                copies = self.connector.gather_copies(
                    kv_caches, layers, plans, [payload for _, _, payload in todo], self._copies.threads
                )
                self._run_copies(kv_caches, copies)
            except ConnectorError as exc:  # e.g. no staging buffer in time: this store is dropped
                self._count_connector_error("store", exc)
                todo = plans = []
            yield from layers
        if not todo:
            return 0
        try:
            self.connector.synchronize()
        except ConnectorError as exc:
            self._count_connector_error("store", exc)
            return 0
        # Sealing (the checksum pass) goes with the tier write, on the store thread in
        # async mode: the caller only waits for the copy out of its cache.
        batch = StoreBatch([])
        for chunk, records, gathered in todo:
            if len(records) > 1:
                self.records.split(gathered, [payload for _, _, payload in records])
            batch.chunks += [
                (key, frame, chunk.num_tokens if i == 0 else 0) for i, (key, frame, _) in enumerate(records)
            ]
        # The manifests due are taken (counted as written) only now, as the batch that writes
        # them is handed over: a layer-wise store abandoned before its last layer (closed,
        # collected, or raising) never gets here, so it leaves them due for the next store.
        for fingerprint in self.records.fingerprints:  # the fingerprints these chunks go under, for explain
            batch.manifests += self._manifests.due(fingerprint, request)
        if self._store_worker is not None:
            self._queued_keys.add([key for key, _, _ in batch.chunks])  # before: the thread may take it at once
            self._store_worker.submit(batch)
        else:
            self._write_batch(batch)
        self.metrics.store_seconds.observe(time.perf_counter() - started)
        return sum(n for _, _, n in batch.chunks)

    def _write_batch(self, batch: StoreBatch) -> None:
        frames = [(key, frame) for key, frame, _ in batch.chunks]
        try:
            self._manifests.write(batch.manifests)
            nbytes = self.chunk_store.put_frames(frames, only_trusted=not self.records.writer)
        finally:  # handed to the tiers (their queues hold what may still land): no longer queued here
            if self._store_worker is not None:
                self._queued_keys.done([key for key, _ in frames])
        self.metrics.stored_tokens.inc(sum(n for _, _, n in batch.chunks))
        self.metrics.stored_bytes.inc(nbytes)
        self._events.emit(
            KVEvent("stored", tuple(k for k, _, _ in batch.chunks), token_counts=tuple(n for _, _, n in batch.chunks))
        )

    def _store_dropped(self, batch: StoreBatch) -> None:
        """The store queue refused ``batch`` (full or closed): counted, its manifests due again."""
        self.metrics.store_dropped.labels("engine").inc()
        self._manifests.forget(batch.manifests)
        self._queued_keys.done([key for key, _, _ in batch.chunks])

    def writes_in_flight(self, keys: Sequence[str]) -> list[bool]:
        """Whether a write of each (record) key may still land in a tier, and be announced
        ``stored`` then: queued for the store thread, for an ``async`` tier, being written, held
        back behind a removal, or landed with its ``stored`` still queued for the listeners
        (another thread delivers the tier's events). ``False`` once that ``stored`` was sent, or
        the write was dropped, declined, refused or failed: then no ``stored`` of it can come
        (until it is stored again)."""
        queued = self._queued_keys.holds(keys)
        return [a or b for a, b in zip(queued, self.chain.writes_pending(keys))]

    def flush_stores(self) -> None:
        """Wait until every store so far is handed to the tiers: written to the ``sync``
        ones, queued for the ``async`` ones (:meth:`flush` waits for those too)."""
        if self._store_worker is not None:
            self._store_worker.flush()

    def _request_config(self, request: RequestInfo | None) -> KVPlugConfig:
        if request is None or not request.overrides:
            return self.config
        return self.config.with_overrides(request.overrides)
