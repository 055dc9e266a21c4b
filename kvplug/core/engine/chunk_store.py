"""``ChunkStore``: chunk keys in, verified chunk tensors out, over a tier chain.

The one place that turns stored bytes back into tensors, for ``CacheEngine`` and for
adapters that manage their own pages (an engine's host-memory page pool). It owns:

- the serializer (built from the config, bounded by ``max_chunk_bytes``) and the
  fingerprint that records it, so a frame is only ever read under the fingerprint
  of the serializer and options that wrote it;
- the tier chain;
- verification on load: every frame is decoded and checked (checksum, format
  version, shape, dtype) before it is used; the first one that fails ends the
  prefix and is removed from every tier (a miss, never wrong data);
- promotion after verification: only chunks that passed are copied into the faster
  tiers. A tier with ``trusted_reads`` serves its bytes without re-checking them,
  so it must never hold a value nobody verified; a tier with ``verified_reads``
  checked its bytes itself (a record checksum over the whole frame), so the frame
  checksum is not computed a second time;
- the store side: frames sealed (without a checksum when only ``trusted_reads``
  tiers will ever read them) and written through to every tier.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.chunk_format import dtype_name
from kvplug.core.config.model import KVPlugConfig
from kvplug.core.events import KVEvent
from kvplug.core.keys import Fingerprint
from kvplug.core.metrics import EngineMetrics
from kvplug.core.plugins import PluginRegistry, get_registry
from kvplug.core.records.frame import record_bound
from kvplug.core.records.integrity import integrity_key
from kvplug.core.serializer import Serializer
from kvplug.core.serializer_factory import make_serializer
from kvplug.core.tenancy import Tenancy
from kvplug.core.tier import TierContext
from kvplug.errors import ChunkError, ConfigError, ConfigProblem, NewerFormatError

logger = logging.getLogger("kvplug.chunk_store")


@dataclass
class LoadedChunks:
    """What :meth:`ChunkStore.load_prefix` found: verified tensors of the leading keys."""

    #: One decoded, verified tensor per leading key, up to the first miss or bad chunk.
    tensors: list[torch.Tensor]
    #: Bytes of the frames those tensors came from.
    nbytes: int = 0
    #: Seconds reading tiers, and decoding and verifying.
    fetch_s: float = 0.0
    verify_s: float = 0.0


class ChunkStore:
    """Keys -> verified chunk tensors over a :class:`~kvplug.TierChain`; see the module docstring.

    Build one with :meth:`open` (from a config), or from parts: ``fingerprint`` must
    already record ``serializer`` (``open`` sees to that).
    """

    def __init__(
        self,
        serializer: Serializer,
        fingerprint: Fingerprint,
        chain: TierChain,
        *,
        metrics: EngineMetrics | None = None,
    ) -> None:
        if fingerprint.serializer != serializer.fingerprint():
            raise ValueError(
                f"the fingerprint records serializer {fingerprint.serializer!r}, "
                f"but frames are written by {serializer.fingerprint()!r}"
            )
        self.serializer = serializer
        self.fingerprint = fingerprint
        self.chain = chain
        #: A replica's store (not the writer of its records): its copies, sealed without a
        #: frame checksum, stay in the process-private tiers, loads' promotions included.
        self.private_copies = False
        self.metrics = metrics or chain.metrics
        #: Whether :meth:`close` closes the serializer too: :meth:`open` made it (parts are the caller's).
        self.owns_serializer = False

    @classmethod
    def open(
        cls,
        config: KVPlugConfig,
        fingerprint: Fingerprint,
        *,
        registry: PluginRegistry | None = None,
        metrics: EngineMetrics | None = None,
        largest_chunk: tuple[tuple[int, ...], torch.dtype] | None = None,
        emit: Callable[[KVEvent], None] | None = None,
        tenancy: Tenancy | None = None,
    ) -> ChunkStore:
        """The configured serializer and tiers under ``fingerprint`` (its ``serializer``
        field is set here).

        ``largest_chunk`` (shape, dtype): a :class:`~kvplug.errors.ConfigError` naming
        ``max_chunk_bytes`` before any tier opens if such a chunk is over that bound,
        since no load of one could then succeed. ``emit`` receives the tiers' events
        (see :meth:`TierChain.open`), ``tenancy`` is shared by the tiers.
        """
        registry = registry or get_registry()
        config = config.resolve(registry)
        if largest_chunk is not None:
            _check_max_chunk_bytes(config, *largest_chunk)
        serializer = make_serializer(config, registry)
        fingerprint = replace(fingerprint, serializer=serializer.fingerprint())
        metrics = metrics or EngineMetrics()
        chunk_bytes = None if largest_chunk is None else math.prod(largest_chunk[0]) * largest_chunk[1].itemsize
        chain = TierChain.open(
            config.tiers,
            registry,
            fingerprint=fingerprint.hexdigest(),
            metrics=metrics,
            lookup_timeout_s=config.lookup_budget_s,
            emit=emit,
            tenancy=tenancy or Tenancy.from_config(config.tenancy, tenant_label_key()),
            max_record_bytes=record_bound(serializer, chunk_bytes),
        )
        store = cls(serializer, fingerprint, chain, metrics=metrics)
        store.owns_serializer = True
        return store

    def reads_chunks_up_to(self, chunk_bytes: int) -> None:
        """Let the tiers read records of chunks of up to ``chunk_bytes`` (decoded): another
        cache that shares them (a hybrid model's group), or records of more KV heads than
        this cache holds (another TP size's). Raises each tier's ``max_record_bytes``."""
        bound = record_bound(self.serializer, chunk_bytes)
        for tier in self.chain.tiers:
            context = getattr(tier, "context", None)  # (a tier written for kvplug 0.2 may keep none)
            if isinstance(context, TierContext) and context.max_record_bytes is not None:
                context.max_record_bytes = max(context.max_record_bytes, bound)

    @property
    def key_prefix(self) -> str:
        """``<format version>/<fingerprint hex>/``: what every key of this store starts with
        (the chunk's hash in hex follows)."""
        return self.fingerprint.key_prefix()

    # --- lookup ---------------------------------------------------------------------

    def contains_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys some tier holds, within the lookup budget."""
        return self.chain.contains_prefix(keys) if keys else 0

    def locate_prefix(self, keys: Sequence[str]) -> list[str]:
        """The fastest tier holding each leading key (see :meth:`TierChain.locate_prefix`)."""
        return self.chain.locate_prefix(keys) if keys else []

    # --- load -----------------------------------------------------------------------

    def load_prefix(self, keys: Sequence[str], shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> LoadedChunks:
        """Verified tensors of the leading ``keys`` some tier holds; ``shapes[i]`` is the
        shape key ``i`` must decode to, ``dtype`` that of every chunk.

        The prefix ends at the first key no tier holds, or at the first frame that fails
        a check (counted in ``load_errors``; its removal from every tier is left to the chain's
        removal thread, :meth:`TierChain.discard_later`: a load never waits for a tier; a frame of a
        later kvplug, :class:`~kvplug.errors.NewerFormatError`, is kept for it). Then the chunks
        that passed, and only those, are promoted into the tiers faster than the one
        that served them.
        """
        if len(shapes) != len(keys):
            raise ValueError(f"load_prefix needs one shape per key: {len(keys)} keys, {len(shapes)} shapes")
        started = time.perf_counter()
        fetched = self.chain.fetch_prefix(keys) if keys else []
        verifying = time.perf_counter()
        loaded = LoadedChunks([], fetch_s=verifying - started)
        for key, shape, hit in zip(keys, shapes, fetched):
            # Frames from trusted_reads tiers are this process's own bytes (written here,
            # or promoted after they passed); a verified_reads tier checked every byte
            # against its record checksum already; frames from anywhere else are verified.
            loads = self.serializer.loads_trusted if hit.trusted else self.serializer.loads
            try:
                tensor = loads(hit.value, expected_shape=shape, expected_dtype=dtype)
            except NewerFormatError as exc:  # a later kvplug's, in a store shared during an upgrade: kept for it
                self.metrics.load_errors.labels(type(exc).__name__).inc()
                logger.warning("chunk %s is a later kvplug's (%s); the prefix ends there", key, exc)
                break
            except ChunkError as exc:
                self.metrics.load_errors.labels(type(exc).__name__).inc()
                logger.warning("chunk %s unusable (%s); the prefix ends there and it is removed", key, exc)
                self.chain.discard_later([(key, hit.value)])  # removed where a tier still holds these bytes
                break
            loaded.tensors.append(tensor)
            loaded.nbytes += memoryview(hit.value).nbytes
        loaded.verify_s = time.perf_counter() - verifying
        self.metrics.loaded_bytes.inc(loaded.nbytes)
        self.chain.promote(
            keys[: len(loaded.tensors)], fetched[: len(loaded.tensors)], only_trusted=self.private_copies
        )
        return loaded

    # --- store ----------------------------------------------------------------------

    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, new_buffer: Callable[[int], Any] = bytearray
    ) -> tuple[Any, torch.Tensor]:
        """A new frame and a writable view of its payload (:meth:`Serializer.allocate`):
        fill the view, then hand the frame to :meth:`put_frames`."""
        return self.serializer.allocate(shape, dtype, new_buffer)

    def put_frames(self, items: Sequence[tuple[str, Any]], *, only_trusted: bool = False) -> int:
        """Seal filled frames from :meth:`allocate` and write each to every tier lacking
        its key; returns the bytes sealed. ``only_trusted``: only to the ``trusted_reads``
        (process-private) tiers, for a copy that another process writes to the shared ones."""
        # A frame only trusted_reads tiers hold never leaves this process: no checksum.
        private = only_trusted or self.chain.all_trusted
        seal = self.serializer.seal_unchecked if private else self.serializer.seal
        sealed = [(key, seal(frame)) for key, frame in items]
        self.chain.put(sealed, only_trusted=only_trusted)
        return sum(memoryview(value).nbytes for _, value in sealed)

    def put_tensors(self, items: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Encode each tensor as a frame and write it like :meth:`put_frames`."""
        frames = []
        for key, tensor in items:
            frame, payload = self.allocate(tuple(tensor.shape), tensor.dtype)
            payload.copy_(tensor)
            frames.append((key, frame))
        return self.put_frames(frames)

    # --- upkeep ---------------------------------------------------------------------

    def discard(self, keys: Sequence[str]) -> None:
        """Remove keys from every tier (this thread waits for each tier's ``remove``)."""
        self.chain.discard(keys)

    def flush(self) -> None:
        """Wait until every write so far is visible in its tier."""
        self.chain.flush()

    def close(self, *, drain: bool = True) -> None:
        """Close the tiers, and the serializer when :meth:`open` made it (its threads end)."""
        self.chain.close(drain=drain)
        if self.owns_serializer:
            self.serializer.close()


def _check_max_chunk_bytes(config: KVPlugConfig, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    bound = int(config.max_chunk_bytes)
    needed = math.prod(shape) * dtype.itemsize
    if needed > bound:
        raise ConfigError(
            [
                ConfigProblem(
                    "max_chunk_bytes",
                    bound,
                    f"a chunk of this model takes {needed} bytes (shape {shape}, {dtype_name(dtype)}): "
                    f"raise max_chunk_bytes to at least {needed} or store smaller chunks (chunk_size, or "
                    "the engine's page size)",
                )
            ]
        )


def tenant_label_key() -> bytes | None:
    """The key of tenant label digests for this deployment: derived from the integrity key
    when one is set (so every rank and restart of engines sharing it agree), else ``None``
    (:class:`~kvplug.core.tenants.TenantLabels` then draws a key of its own)."""
    key = integrity_key()
    return None if key is None else key.mac(b"kvplug tenant labels", b"")
