"""``CacheEngine``: the one object an engine adapter talks to.

It turns token ids into chunk keys, gathers chunks out of the engine's paged KV
cache into serializer frames and hands them to the tier chain (``store``), answers
how much of a prompt is cached (``lookup``), and scatters cached chunks back into
the paged cache (``retrieve``), whole or layer by layer.

Storage and chunk failures never escape ``lookup``/``store``/``retrieve``: they
shorten the hit and are counted. Wrong arguments (a slot mapping of the wrong
length, caches that do not match the layout) raise at once, before any work.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvplug.core.background import BackgroundWorker
from kvplug.core.chunk_format import dtype_name
from kvplug.core.config import KVPlugConfig
from kvplug.core.connector import KVConnector, LayerCache
from kvplug.core.events import EventListener, EventListeners, KVEvent
from kvplug.core.frame_pool import FramePool
from kvplug.core.keys import ChunkKey, ExtraKey, Fingerprint, KeyBuilder
from kvplug.core.layouts import KVLayout
from kvplug.core.metrics import EngineMetrics
from kvplug.core.parallel_copies import ParallelCopies, auto_copy_threads
from kvplug.core.plugins import PluginRegistry, get_registry
from kvplug.core.serializer import Serializer
from kvplug.core.serializer_factory import make_serializer
from kvplug.core.tier_chain import TierChain
from kvplug.errors import ChunkError, ConfigError, ConfigProblem, ConnectorError, EngineClosedError, LayoutError

logger = logging.getLogger("kvplug.engine")

#: What the store worker writes: (key, filled but not yet sealed frame, tokens) per chunk.
StoreBatch = list[tuple[str, Any, int]]


@dataclass(frozen=True)
class RequestInfo:
    """What one request adds to the shared config: isolation, extra keys, overrides."""

    cache_salt: str | None = None
    lora_id: str | None = None
    extra_keys: tuple[ExtraKey, ...] = ()
    overrides: Mapping[str, Any] = field(default_factory=dict)


_NO_REQUEST = RequestInfo()


@dataclass
class RetrieveTimings:
    """Where one retrieve's time went, in seconds: tier reads, decoding and verifying, writing into the cache."""

    fetch_s: float = 0.0
    verify_s: float = 0.0
    write_s: float = 0.0


class CacheEngine:
    """Store, look up and retrieve KV chunks of one model's paged cache."""

    def __init__(
        self,
        config: KVPlugConfig,
        layout: KVLayout,
        fingerprint: Fingerprint,
        *,
        registry: PluginRegistry | None = None,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.registry = registry or get_registry()
        self.config = config.resolve(self.registry)
        self.layout = layout
        self.metrics = metrics or EngineMetrics()
        self._check_max_chunk_bytes()
        self.serializer: Serializer = make_serializer(self.config, self.registry)
        self.fingerprint = replace(
            fingerprint,
            serializer=self.serializer.fingerprint(),
            kv_layout=layout.describe(),
            dtype=dtype_name(layout.dtype),
        )
        self.connector: KVConnector = self._make_connector()
        self._copies = ParallelCopies(self._copy_threads())
        self.key_builder = KeyBuilder(self.config.chunk_size, self.config.hash)
        self._events = EventListeners(self.registry.emit)
        self.chain = TierChain.open(
            self.config.tiers,
            self.registry,
            fingerprint=self.fingerprint.hexdigest(),
            metrics=self.metrics,
            lookup_timeout_s=self.config.lookup_timeout_ms / 1000,
            emit=self._events.emit,
        )
        pin_frames = self.connector.wants_pinned_frames()
        self.frame_pool = FramePool(
            self._frame_pool_bytes(self.chain), pin=pin_frames, prefault=self.config.store.prefault_frames
        )
        self._store_worker: BackgroundWorker[StoreBatch] | None = None
        if self.config.store.mode == "async":
            self._store_worker = BackgroundWorker(
                "kvplug-store",
                self._write_batch,
                max_items=self.config.store.queue_max_batches,
                max_bytes=int(self.config.store.queue_max_bytes),
                size_of=lambda batch: sum(memoryview(frame).nbytes for _, frame, _ in batch),
                on_full=self.config.store.on_full,
                block_timeout_s=self.config.store.block_timeout_s,
                on_drop=lambda batch: self.metrics.store_dropped.labels("engine").inc(),
            )
        self._closed = False

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    def add_event_listener(self, listener: EventListener) -> None:
        """Call ``listener(event)`` for each :class:`~kvplug.KVEvent` of this engine (its
        stores and loads, its tiers' evictions and removals) until
        :meth:`remove_event_listener`; never for another engine's, unlike the
        process-wide ``kvplug_on_event`` hook. It runs on the thread that caused the
        event (often a storage worker) and must be quick; an exception is logged."""
        self._events.add(listener)

    def remove_event_listener(self, listener: EventListener) -> None:
        self._events.remove(listener)

    # --- keys -----------------------------------------------------------------------

    def chunk_keys(
        self, tokens: Sequence[int] | torch.Tensor, request: RequestInfo | None = None, *, include_partial: bool = True
    ) -> list[ChunkKey]:
        request = request or _NO_REQUEST
        fingerprint = self.fingerprint.for_request(cache_salt=request.cache_salt, lora_id=request.lora_id)
        return self.key_builder.keys(
            tokens, fingerprint, extra_keys=request.extra_keys, include_partial=include_partial
        )

    # --- lookup ---------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int] | torch.Tensor, *, request: RequestInfo | None = None) -> int:
        """Length of the cached prefix in tokens: whole chunks, or the full prompt."""
        self._check_open()
        keys = self.chunk_keys(tokens, request)
        hit = self.chain.contains_prefix([k.key for k in keys]) if keys else 0
        tokens_hit = keys[hit - 1].end if hit else 0
        self._count_lookup(len(tokens), tokens_hit)
        return tokens_hit

    def lookup_tiers(
        self, tokens: Sequence[int] | torch.Tensor, *, request: RequestInfo | None = None
    ) -> list[tuple[str, int]]:
        """Like :meth:`lookup`, per chunk of the cached prefix: (fastest tier holding it, its tokens).

        The hit length is the sum of the token counts. An adapter uses the tier names
        to load a prefix that needs a slow tier asynchronously.
        """
        self._check_open()
        keys = self.chunk_keys(tokens, request)
        tiers = self.chain.locate_prefix([k.key for k in keys]) if keys else []
        self._count_lookup(len(tokens), keys[len(tiers) - 1].end if tiers else 0)
        return [(name, key.num_tokens) for name, key in zip(tiers, keys)]

    def _count_lookup(self, asked: int, hit: int) -> None:
        self.metrics.lookups.inc()
        self.metrics.lookup_tokens.inc(asked)
        self.metrics.lookup_hit_tokens.inc(hit)

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
        entries must form a prefix (tokens stored earlier). The copy out of
        ``kv_caches`` is done before returning; writing to tiers may not be.
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
        first = self._check_call(tokens, kv_caches, slots, mask)
        config = self._request_config(request)
        todo: list[tuple[ChunkKey, Any, torch.Tensor]] = []
        if not config.skip_save:
            try:
                keys = [
                    k
                    for k in self.chunk_keys(tokens, request, include_partial=config.save_unfull_chunk)
                    if k.end > first and self._copyable(k.start, k.end)
                ]
                stored = self.chain.contains_any([k.key for k in keys], sync_tiers_only=True) if keys else []
                for chunk, present in zip(keys, stored):
                    if present:
                        continue
                    frame, payload = self.serializer.allocate(
                        self.layout.chunk_shape(chunk.num_tokens), self.layout.dtype, self.frame_pool.new_buffer
                    )
                    todo.append((chunk, frame, payload))
            except Exception:
                logger.exception("store: preparing chunks failed; nothing stored")
                todo = []
        return self._store_layers(kv_caches, slots.to(torch.long), todo, layers_per_step)

    def _store_layers(
        self,
        kv_caches: Sequence[LayerCache],
        slots: torch.Tensor,
        todo: list[tuple[ChunkKey, Any, torch.Tensor]],
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
        batch = [(chunk.key, frame, chunk.num_tokens) for chunk, frame, _ in todo]
        if self._store_worker is not None:
            self._store_worker.submit(batch)
        else:
            self._write_batch(batch)
        self.metrics.store_seconds.observe(time.perf_counter() - started)
        return sum(n for _, _, n in batch)

    def _write_batch(self, batch: StoreBatch) -> None:
        seal = self.serializer.seal_unchecked if self.chain.all_trusted else self.serializer.seal
        sealed = [(key, seal(frame)) for key, frame, _ in batch]
        self.chain.put(sealed)
        self.metrics.stored_tokens.inc(sum(n for _, _, n in batch))
        self.metrics.stored_bytes.inc(sum(memoryview(frame).nbytes for _, frame in sealed))
        self._events.emit(KVEvent("stored", tuple(k for k, _, _ in batch), token_counts=tuple(n for _, _, n in batch)))

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
    ) -> LayerwiseRetrieve:
        """Fetch and verify the cached chunks now; iterate to write them layer by layer."""
        self._check_open()
        first = self._check_call(tokens, kv_caches, slots, mask)
        started = time.perf_counter()
        timings = RetrieveTimings()
        chunks: list[tuple[ChunkKey, torch.Tensor]] = []
        try:
            if self.layout.whole_blocks_only:  # a block is loaded whole or not at all
                first = -(-first // self.layout.block_size) * self.layout.block_size
            keys = [
                k
                for k in self.chunk_keys(tokens, request)
                if k.end > first and self._copyable(max(k.start, first), k.end)
            ]
            fetched = self.chain.fetch_prefix([k.key for k in keys]) if keys else []
            verifying = time.perf_counter()
            timings.fetch_s = verifying - started
            for chunk, hit in zip(keys, fetched):
                # Frames from trusted_reads tiers are this process's own bytes; frames
                # from anywhere else are verified (see StorageTier.trusted_reads).
                loads = self.serializer.loads_trusted if hit.trusted else self.serializer.loads
                try:
                    tensor = loads(
                        hit.value,
                        expected_shape=self.layout.chunk_shape(chunk.num_tokens),
                        expected_dtype=self.layout.dtype,
                    )
                except ChunkError as exc:
                    self.metrics.load_errors.labels(type(exc).__name__).inc()
                    logger.warning("chunk %s unusable (%s); prefix ends there", chunk.key, exc)
                    self.chain.discard([chunk.key])
                    break
                self.metrics.loaded_bytes.inc(memoryview(hit.value).nbytes)
                chunks.append((chunk, tensor))
            timings.verify_s = time.perf_counter() - verifying
            # Only verified chunks go up to the faster tiers.
            self.chain.promote([chunk.key for chunk, _ in chunks], fetched[: len(chunks)])
        except Exception:
            logger.exception("retrieve: fetching chunks failed; loading what was fetched")
        return LayerwiseRetrieve(self, len(tokens), first, kv_caches, slots.to(torch.long), chunks, started, timings)

    # --- lifecycle ------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every store so far is visible in every tier."""
        if self._store_worker is not None:
            self._store_worker.flush()
        self.chain.flush()

    def close(self, *, drain: bool = True) -> None:
        """Stop the store worker (writing what is queued when ``drain``) and close tiers."""
        if self._closed:
            return
        self._closed = True
        if self._store_worker is not None:
            self._store_worker.close(drain=drain)
        self.chain.close(drain=drain)
        self._copies.close()
        self.frame_pool.close()

    def __enter__(self) -> CacheEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- helpers --------------------------------------------------------------------

    def _make_connector(self) -> KVConnector:
        spec = self.config.connector
        connectors = self.registry.kv_connectors()
        if spec.type != "auto":
            return connectors[spec.type](spec.options, self.layout)
        usable = [cls for cls in connectors.values() if cls.is_available()]
        chosen = max(usable, key=lambda cls: cls.priority)
        logger.info("connector auto: chose %r of %s", chosen.name, sorted(c.name for c in usable))
        return chosen(chosen.Config(), self.layout)

    def _check_max_chunk_bytes(self) -> None:
        """``ConfigError`` unless ``max_chunk_bytes`` holds this model's largest chunk (else no load could succeed)."""
        bound = int(self.config.max_chunk_bytes)
        shape = self.layout.chunk_shape(self.config.chunk_size)
        needed = math.prod(shape) * self.layout.dtype.itemsize
        if needed > bound:
            raise ConfigError(
                [
                    ConfigProblem(
                        "max_chunk_bytes",
                        bound,
                        f"a chunk of this model takes {needed} bytes (shape {shape}, {dtype_name(self.layout.dtype)}): "
                        f"raise max_chunk_bytes to at least {needed} or lower chunk_size",
                    )
                ]
            )

    def _copy_threads(self) -> int:
        if not self.connector.concurrent_copies:
            return 1
        configured = self.config.copy_threads
        return auto_copy_threads() if configured == "auto" else configured

    def _run_copies(self, kv_caches: Sequence[LayerCache], copies: Sequence[Callable[[], None]]) -> None:
        """Run copies out of or into the cache, on the copy threads when it is in host memory."""
        on_host = bool(kv_caches) and self.layout.layer_tensors(kv_caches[0])[0].device.type == "cpu"
        self._copies.run(copies, parallel=on_host)

    def _count_connector_error(self, operation: str, exc: ConnectorError) -> None:
        self.metrics.load_errors.labels(type(exc).__name__).inc()
        logger.warning("%s: connector %s failed (%s); treated as a miss", operation, self.connector.name, exc)

    def _frame_pool_bytes(self, chain: TierChain) -> int:
        configured = self.config.store.frame_pool_bytes
        if configured is not None:
            return int(configured)
        held = sum(int(s.max_bytes or 0) for t, s in zip(chain.tiers, chain.settings) if t.keeps_buffers)
        return held + 256 * 2**20

    def _copyable(self, start: int, end: int) -> bool:
        """Whether tokens ``[start, end)`` can be copied in this layout."""
        size = self.layout.block_size
        return not self.layout.whole_blocks_only or (start % size == 0 and end % size == 0)

    def _request_config(self, request: RequestInfo | None) -> KVPlugConfig:
        if request is None or not request.overrides:
            return self.config
        return self.config.with_overrides(request.overrides)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the cache engine is closed")

    def _check_call(
        self,
        tokens: Sequence[int] | torch.Tensor,
        kv_caches: Sequence[LayerCache],
        slots: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> int:
        """Validate arguments; return the index of the first token ``mask`` selects."""
        self.layout.check_caches(kv_caches)
        if slots.dim() != 1 or slots.numel() != len(tokens):
            raise LayoutError(
                f"slots must be 1-D with one entry per token ({len(tokens)}), got shape {tuple(slots.shape)}"
            )
        if mask is None:
            return 0
        if mask.dim() != 1 or mask.numel() != len(tokens) or mask.dtype != torch.bool:
            raise LayoutError(
                f"mask must be a 1-D bool tensor of {len(tokens)} entries, got {mask.dtype} {tuple(mask.shape)}"
            )
        first = int(torch.count_nonzero(~mask))
        if not bool(mask[first:].all()):
            raise LayoutError("mask must be False for a prefix of the tokens and True after it")
        return first


class LayerwiseRetrieve(Iterator[int]):
    """Chunks fetched and verified; each ``next()`` writes one layer, yielding its index.

    ``loaded_mask`` and ``num_loaded_tokens`` are known before the first layer is
    written, so an engine can plan its compute while layers stream in. ``timings``
    says where the time went (the write time grows as layers are written).
    """

    def __init__(
        self,
        engine: CacheEngine,
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
            self._plans, self._spans, self._chunks = [], [], []
            self.loaded_mask.zero_()
            self.num_loaded_tokens = 0
        self.timings.write_s += time.perf_counter() - started
        self._next_layer = layers.stop
        if self._next_layer == engine.layout.num_layers:
            self._finish()

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
