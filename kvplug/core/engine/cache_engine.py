"""``CacheEngine``: the one object an engine adapter talks to.

It turns token ids into chunk keys, gathers chunks out of the engine's paged KV cache
into the chunk store (``store``), answers how much of a prompt is cached (``lookup``),
and scatters cached chunks back into the paged cache (``retrieve``), whole or by layer.

Storage and chunk failures never escape ``lookup``/``store``/``retrieve``: they
shorten the hit and are counted. Wrong arguments (a slot mapping of the wrong
length, caches that do not match the layout) raise at once, before any work.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

import torch

from kvplug.core.background import BackgroundWorker
from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.chunk_format import dtype_name
from kvplug.core.config.model import KVPlugConfig
from kvplug.core.connector import KVConnector
from kvplug.core.engine.chunk_store import ChunkStore
from kvplug.core.engine.frame_pool import FramePool
from kvplug.core.engine.head_shards import HeadRecords, HeadShard
from kvplug.core.engine.locations import ChunkLocation, chunk_hash, hit_tokens, is_chunk_hash, locate_inline
from kvplug.core.engine.parallel_copies import ParallelCopies, auto_copy_threads
from kvplug.core.engine.prompt_pins import pin_prompt, unpin_prompt
from kvplug.core.engine.retrieves import EngineRetrieves
from kvplug.core.engine.split_lookup import located_prefix
from kvplug.core.engine.stores import EngineStores, QueuedKeys, StoreBatch
from kvplug.core.engine.tails import HeldTail, longest_held_tail, tail_lengths
from kvplug.core.events import EventListener, EventListeners
from kvplug.core.keys import ChunkKey, Fingerprint, KeyBuilder, RequestInfo
from kvplug.core.layouts import KVLayout
from kvplug.core.metrics import EngineMetrics
from kvplug.core.pins import apply_configured_pins
from kvplug.core.plugins import PluginRegistry, get_registry
from kvplug.core.records.manifest import ManifestWriter
from kvplug.core.serializer import Serializer
from kvplug.core.tenancy import PinReport
from kvplug.errors import ConfigError, ConfigProblem, EngineClosedError

logger = logging.getLogger("kvplug.engine")


_NO_REQUEST = RequestInfo()
#: Salted isolations whose record fingerprints an engine keeps computed (a few hashes each).
_MAX_NOTED_ISOLATIONS = 4096


class CacheEngine(EngineRetrieves, EngineStores):
    """Store, look up and retrieve KV chunks of one model's paged cache."""

    def __init__(
        self,
        config: KVPlugConfig,
        layout: KVLayout,
        fingerprint: Fingerprint,
        *,
        registry: PluginRegistry | None = None,
        metrics: EngineMetrics | None = None,
        shares_tiers_with: CacheEngine | None = None,
        heads: HeadShard | None = None,
    ) -> None:
        self.registry = registry or get_registry()
        self.config = config.resolve(self.registry)
        if layout.whole_blocks_only and self.config.chunk_size % layout.block_size:
            # No chunk of such a layout could be copied: every store would store nothing, silently.
            problem = ConfigProblem(
                "chunk_size",
                self.config.chunk_size,
                f"must be a multiple of the block size {layout.block_size}: "
                f"the {layout.format.name} layout copies whole blocks only",
            )
            raise ConfigError([problem])
        self.layout = layout
        self.metrics = metrics or EngineMetrics()
        self.connector: KVConnector = self._make_connector()
        self._events = EventListeners(self.registry.emit)
        # Serializer, fingerprint and tiers: loads are verified and only verified chunks promoted.
        fingerprint = replace(fingerprint, kv_layout=layout.describe(), dtype=dtype_name(layout.dtype))
        #: A chunk is one record per group of this cache's KV heads (``heads``; None: one
        #: record), keyed by head range: engines of any TP size read what they hold.
        self.records = HeadRecords(layout, fingerprint, heads, any_tp_size=self.config.tp_sharing == "any")
        fingerprint = self.records.fingerprints[0]
        #: Another engine's tiers this one stores into (one engine per KV cache group of a
        #: hybrid model): its own fingerprint keeps the keys apart; the owner closes them.
        self._owns_tiers = shares_tiers_with is None
        if shares_tiers_with is None:
            self.chunk_store = ChunkStore.open(
                self.config,
                fingerprint,
                registry=self.registry,
                metrics=self.metrics,
                largest_chunk=(layout.chunk_shape(self.config.chunk_size), layout.dtype),
                emit=self._events.emit,
            )
        else:
            owner = shares_tiers_with.chunk_store
            self.chunk_store = ChunkStore(
                owner.serializer,
                replace(fingerprint, serializer=owner.serializer.fingerprint()),
                owner.chain,
                metrics=self.metrics,
            )
        self.serializer: Serializer = self.chunk_store.serializer
        self.fingerprint = self.chunk_store.fingerprint
        # Again with the chunk store's serializer in the fingerprint: every record key names it.
        self.records = HeadRecords(layout, self.fingerprint, heads, any_tp_size=self.config.tp_sharing == "any")
        self._record_fingerprints: OrderedDict[tuple[str, str | None], list[str]] = OrderedDict()
        self._record_fingerprints_lock = threading.Lock()
        self.chunk_store.private_copies = not self.records.writer
        # The tiers' record bound (a larger file is corrupt, never read) holds every record this cache reads.
        self.chunk_store.reads_chunks_up_to(self.records.largest_chunk_read(self.config.chunk_size))
        self.chain = self.chunk_store.chain
        self._copies = ParallelCopies(self._copy_threads())
        self.key_builder = KeyBuilder(self.config.chunk_size, self.config.hash)
        self._manifests = ManifestWriter(self.chain, self.config.chunk_size, self.config.hash)
        pin_frames = self.connector.wants_pinned_frames()
        self.frame_pool = FramePool(
            self._frame_pool_bytes(self.chain), pin=pin_frames, prefault=self.config.store.prefault_frames
        )
        self._store_worker: BackgroundWorker[StoreBatch] | None = None
        self._queued_keys = QueuedKeys()
        queue = self.config.store.queue
        if queue.mode == "async":
            self._store_worker = BackgroundWorker(
                "kvplug-store",
                self._write_batch,
                max_items=queue.max_items,
                max_bytes=int(queue.max_bytes),
                size_of=StoreBatch.nbytes,
                on_full=queue.on_full,
                block_timeout_s=queue.block_timeout_s,
                on_drop=self._store_dropped,
            )
        self._closed = False
        apply_configured_pins(self, self.config.pin)

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
        self,
        tokens: Sequence[int] | torch.Tensor,
        request: RequestInfo | None = None,
        *,
        include_partial: bool = True,
        hashes: Sequence[str] | None = None,
    ) -> list[ChunkKey]:
        """The keys of the prompt's chunks under ``request``'s salt and LoRA; ``hashes``: those a lookup of
        these tokens found (:attr:`ChunkLocation.chunk_hash`), see :meth:`KeyBuilder.keys_from_hashes`."""
        request = request or _NO_REQUEST
        prefix = self._key_prefix(request)
        extra, builder = request.extra_keys, self.key_builder
        if hashes is not None and all(map(is_chunk_hash, hashes)):
            keys = builder.keys_from_hashes(tokens, prefix, hashes, extra_keys=extra, include_partial=include_partial)
            if keys is not None:
                return keys
        return builder.keys(tokens, prefix, extra_keys=extra, include_partial=include_partial)

    def _key_prefix(self, request: RequestInfo) -> str:
        """The key prefix of ``request``'s chunks (:meth:`Fingerprint.key_prefix` under its salt
        and LoRA), noting the salt's fingerprints for the tenant tiers that count keys by salt."""
        fingerprint = self.fingerprint.for_request(cache_salt=request.cache_salt, lora_id=request.lora_id)
        fingerprint_hex = fingerprint.hexdigest()
        tenants = self.chain.tenancy.tenants
        tenants.note(fingerprint_hex, request.cache_salt)
        if request.cache_salt is not None:
            for other in self._other_record_fingerprints(request.cache_salt, request.lora_id):
                tenants.note(other, request.cache_salt)
        return f"{fingerprint.format_version}/{fingerprint_hex}/"

    def _other_record_fingerprints(self, salt: str, lora_id: str | None) -> list[str]:
        """The fingerprints (hex) of a salted request's records past record 0: its other head
        groups' and other TP sizes' splits (whose records a load promotes). They are the tenant's
        too: unnoted, they counted as unsalted, outside its quota."""
        key = (salt, lora_id)
        known = self._record_fingerprints.get(key)
        if known is None:
            fingerprints = [*self.records.fingerprints[1:], *(f for o in self.records.others for f in o.fingerprints)]
            known = [f.for_request(cache_salt=salt, lora_id=lora_id).hexdigest() for f in fingerprints]
            with self._record_fingerprints_lock:
                self._record_fingerprints[key] = known
                while len(self._record_fingerprints) > _MAX_NOTED_ISOLATIONS:
                    self._record_fingerprints.popitem(last=False)
        return known

    # --- pins -----------------------------------------------------------------------

    def pin(self, tokens: Sequence[int] | torch.Tensor, *, request: RequestInfo | None = None) -> PinReport:
        """Keep the prompt's chunks (as a store of it with ``request`` keys them) from eviction
        in every tier that keeps pins, within each tier's ``pin_max_bytes``: at once where
        held, and chunks not stored yet when they are (in this process: see docs/operations.md).
        The chunks are those a store writes, the tail of ``block_granular_hits`` too; where this
        engine's records of the first chunk (or of the tail) are held nowhere, another TP size's
        that a load reads are pinned (:func:`~kvplug.core.engine.prompt_pins.pin_prompt`)."""
        self._check_open()
        prefix, tail = self.stored_prefix_and_tail(tokens, request, self._request_config(request))
        return pin_prompt(self.chain, self.records, prefix + tail, request, prefix=len(prefix))

    def unpin(self, tokens: Sequence[int] | torch.Tensor, *, request: RequestInfo | None = None) -> PinReport:
        """Make the prompt's chunks evictable again (the reverse of :meth:`pin`)."""
        self._check_open()
        config = self._request_config(request)
        keys = self.stored_keys(tokens, request, config)
        # A partial last chunk that a request's own save_unfull_chunk pinned is released too, but
        # is not missing where this config stores none.
        stored = {key.key for key in keys}
        partial = [] if config.save_unfull_chunk else self.stored_keys(tokens, request, config, include_partial=True)
        return unpin_prompt(self.chain, self.records, keys, request, [k for k in partial if k.key not in stored])

    # --- lookup ---------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int] | torch.Tensor, *, request: RequestInfo | None = None) -> int:
        """Length of the cached prefix in tokens: whole chunks, or the full prompt."""
        return hit_tokens(self.locate(tokens, request=request))

    def locate(
        self, tokens: Sequence[int] | torch.Tensor, *, request: RequestInfo | None = None
    ) -> list[ChunkLocation]:
        """Like :meth:`lookup`, per chunk of the cached prefix: where it is (the medium and
        name of the fastest tier holding it) and its tokens. The hit length is the sum of
        the token counts; an adapter loads a prefix that needs a slow medium asynchronously."""
        self._check_open()
        keys = self.chunk_keys(tokens, request)
        tiers = located_prefix(self.records, self.chain, [k.key for k in keys], request, self._tier_order())
        found = list(zip(tiers, keys))
        if len(tiers) < len(keys) and self.config.block_granular_hits:
            tail = self._located_tail(tokens, keys, len(tiers), request)
            if tail is not None:
                found.append((tail.tier, tail.key))
        self.count_lookup(len(tokens), found[-1][1].end if found else 0)
        # The chain's tiers by label (``<index>:<type>``), so two tiers of one type stay apart.
        position = {label: index for index, label in enumerate(self.chain.labels)}
        chain = self.chain.tiers
        return [
            ChunkLocation(chain[at].medium, chain[at].name, key.num_tokens, chunk_hash(key.key), at)
            for at, key in ((position[label], key) for label, key in found)
        ]

    def _located_tail(
        self, tokens: Sequence[int] | torch.Tensor, keys: Sequence[ChunkKey], held: int, request: RequestInfo | None
    ) -> HeldTail | None:
        """The longest stored tail (:mod:`kvplug.core.engine.tails`) of chunk ``held``, the first
        chunk of ``keys`` not held whole, the tier it is in and the split of the heads holding it."""
        missing = keys[held]
        lengths = tail_lengths(missing.start, missing.num_tokens, self.layout.block_size)
        if not lengths:
            return None
        candidates = self._tail_keys(tokens, keys[held - 1] if held else None, lengths, request)
        return longest_held_tail(self.records, self.chain, candidates, request, self._tier_order())

    def locate_inline(
        self, tokens: Sequence[int] | torch.Tensor, *, request: RequestInfo | None = None, count: bool = True
    ) -> list[ChunkLocation] | None:
        """:meth:`locate` asking only the tiers that answer on the caller's thread (memory,
        ``inline_lookups``), or ``None`` when a slower tier could add to their answer;
        ``count=False``: not counted (the caller counts it with :meth:`count_lookup`)."""
        self._check_open()
        keys = self.chunk_keys(tokens, request)
        records = self.record_keys(keys, request)
        if any(self.chain.being_removed(records) or ()):  # found unusable: the full lookup leaves them out
            return None
        found = locate_inline(
            keys,
            records,
            self.records.count,
            self.chain.tiers,
            chunk_size=self.chunk_size,
            # the partial chunk's tail may be in a slower tier, as the partial chunk itself may,
            # also where only a request's own save_unfull_chunk stored one
            save_unfull_chunk=self.config.save_unfull_chunk
            or self.config.block_granular_hits
            or self._stored_partial_chunks,
        )
        if found is not None and count:
            self.count_lookup(len(tokens), keys[len(found) - 1].end if found else 0)
        return found

    def record_keys(self, keys: Sequence[ChunkKey], request: RequestInfo | None = None) -> list[str]:
        """The keys of the records of chunks ``keys`` (``records.count`` per chunk, one per
        head group, chunk by chunk); a chunk is cached only when all of its records are."""
        return self.records.record_keys([k.key for k in keys], request)

    def _tier_order(self) -> list[str]:
        return self.chain.labels

    def count_lookup(self, asked: int, hit: int) -> None:
        """Count one lookup of ``asked`` tokens that found ``hit``."""
        self.metrics.lookups.inc()
        self.metrics.lookup_tokens.inc(asked)
        self.metrics.lookup_hit_tokens.inc(hit)

    # --- lifecycle ------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every store so far is visible in every tier."""
        self.flush_stores()
        self.chain.flush()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called: a closed engine stores, loads and counts nothing more."""
        return self._closed

    def close(self, *, drain: bool = True) -> None:
        """Stop the store worker (writing what is queued when ``drain``) and close tiers."""
        if self._closed:
            return
        self._closed = True
        if self._store_worker is not None:
            self._store_worker.close(drain=drain and self.config.store.queue.on_close == "drain")
        if self._owns_tiers:  # (an engine sharing another's tiers shares its serializer too)
            self.chunk_store.close(drain=drain)
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

    def _copy_threads(self) -> int:
        if not self.connector.concurrent_copies:
            return 1
        configured = self.config.copy_threads
        return auto_copy_threads() if configured == "auto" else configured

    def _frame_pool_bytes(self, chain: TierChain) -> int:
        configured = self.config.store.frame_pool_bytes
        if configured is not None:
            return int(configured)
        held = sum(int(s.max_bytes or 0) for t, s in zip(chain.tiers, chain.settings) if t.keeps_buffers)
        return held + 256 * 2**20

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the cache engine is closed")
