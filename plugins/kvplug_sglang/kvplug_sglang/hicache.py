"""HiCache storage backend ``KVPlugStorage``: SGLang's L3 cache on kvplug tiers.

Turn it on with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvplug",
        "module_path": "kvplug_sglang.hicache", "class_name": "KVPlugStorage",
        "interface_v1": 1, "kvplug": {"tiers": [{"type": "cpu", "max_bytes": "8GiB"}]}}'

kvplug's config is the ``kvplug`` mapping (or ``kvplug.``-prefixed keys, or
``"kvplug.config": "<yaml file>"``) of that JSON, over ``KVPLUG_CONFIG`` and
``KVPLUG_*``; ``"read_timeout_s"`` there bounds each lookup and load (default 10 s: past
it, a miss). Only the tiers and the serializer matter here: SGLang cuts pages
and names them itself (``page_i = sha256(page_{i-1} || tokens_i)``, seeded with
the request's ``extra_key``/``cache_salt``).

A page is stored under ``<kv format version>/<fingerprint hex>/<sha256 of SGLang's
key>`` as a serializer frame (checksummed) of the page in canonical order
(:mod:`kvplug_sglang.host_pages`); persistent tiers add their record checksums.
Pages go through :class:`kvplug.ChunkStore`, as ``CacheEngine``'s chunks do: a page
that fails a check is a miss and is removed, and only pages that passed are
promoted into faster tiers.

Supported: MHA host pools in every plain layout (``layer_first``, ``page_first``,
``page_first_direct``, ``page_head``) and MLA host pools, through the generic
(``get``/``set``/``batch_*``) and zero-copy v1 (``batch_*_v1``) interfaces. The v2
pool-transfer calls work for the ``kv`` pool; other pools (Mamba, SWA, DSA
indexer, ...) are refused at registration and report no hits.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

import kvplug
from kvplug import ChunkStore, ControlServer
from kvplug.errors import LayoutError
from kvplug_sglang.at_exit import close_at_exit, within_exit_wait
from kvplug_sglang.bounded_reads import BoundedReads
from kvplug_sglang.control import HiCacheControl, rank_in_replica, start_control
from kvplug_sglang.host_pages import HostPageFormat
from kvplug_sglang.page_identity import (
    cp_shard,
    kv_cache_variant,
    loaded_checkpoint,
    weights_generation,
    weights_variant,
)

logger = logging.getLogger("kvplug.sglang.hicache")

#: extra_config keys that belong to SGLang's dynamic-backend loader, not to kvplug.
_LOADER_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"}
#: The longest a lookup or load waits for the tiers (``"read_timeout_s"`` in the extra config);
#: past it the pages are a miss (see :mod:`kvplug_sglang.bounded_reads`).
READ_TIMEOUT_S = 10.0


class KVPlugStorage(HiCacheStorage):
    """HiCache L3 storage on a kvplug :class:`~kvplug.ChunkStore`.

    SGLang names, cuts and copies pages itself, so this backend needs no
    ``CacheEngine`` (token keys, a paged-cache connector): only the store that
    encodes, verifies, promotes and discards them.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        engine_extra = {k: v for k, v in extra.items() if k == "kvplug" or k.startswith("kvplug.")}
        self.config = kvplug.load_config(engine_extra=engine_extra).config
        #: What ``kvplug ctl`` names this server by: SGLang's model name (the served name).
        self.name = str(extra.get("model_id") or storage_config.model_name or "")
        # Keys name the checkpoint SGLang loaded, not the served name: two servers that serve
        # different weights under one --served-model-name must not read each other's pages.
        checkpoint, self.model_revision = loaded_checkpoint()
        self.model_id = str(extra.get("model_id") or checkpoint or self.name)
        if not self.model_id:
            raise ValueError(
                "KVPlugStorage needs the model's identity for its keys: SGLang passes model_name; "
                'or set "model_id" in --hicache-storage-backend-extra-config'
            )
        self.read_timeout_s = _read_timeout(extra)
        self.registry = kvplug.get_registry()
        self.mem_pool_host: Any = None
        self.page_format: HostPageFormat | None = None
        self.store: ChunkStore | None = None
        #: What ``kvplug ctl`` asks, and the journal of the pages this backend wrote.
        self.target: HiCacheControl | None = None
        self.control: ControlServer | None = None
        self._unsupported_pools: set[str] = set()
        self._closed = False
        #: Lookups and loads, each waited for at most ``read_timeout_s``.
        self.reads = BoundedReads(self.read_timeout_s)

    # --- registration -----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the page format and open the tiers (keys depend on the format)."""
        page_format = HostPageFormat.of(mem_pool_host)
        if self.store is not None:
            if page_format != self.page_format:
                raise LayoutError("KVPlugStorage: a second host pool with another page format was registered")
            self.mem_pool_host = mem_pool_host
            return
        cfg = self.storage_config
        # MLA KV is the same on every TP rank of one DCP shard; with DCP each shard holds other
        # tokens of a page under the same SGLang key, so the shard is part of kvplug's key.
        replicated = page_format.is_mla
        fingerprint = kvplug.Fingerprint(
            model_id=self.model_id,
            model_revision=self.model_revision,
            # A host pool's own page format, which SGLang tags its model name with.
            engine_variant=str(getattr(mem_pool_host, "storage_format_tag", None) or "")
            + kv_cache_variant()
            + weights_variant(),
            kv_layout=page_format.describe() + (":split" if cfg.should_split_heads else "") + cp_shard(cfg),
            dtype=kvplug.dtype_name(page_format.dtype),
            block_size=page_format.page_size,
            tp_rank=cfg.dcp_rank if replicated else cfg.tp_rank,
            tp_size=cfg.dcp_size if replicated else cfg.tp_size,
            pp_rank=cfg.pp_rank,
            pp_size=cfg.pp_size,
        )
        self.store = ChunkStore.open(
            self.config,
            fingerprint,
            registry=self.registry,
            largest_chunk=(page_format.canonical_shape, page_format.dtype),
            emit=self._on_event,
        )
        self.mem_pool_host = mem_pool_host
        self.page_format = page_format
        self.target = target = HiCacheControl(self, self.store, page_format.indices_per_page)
        # Under attention DP SGLang hands over the attention-TP rank, which attention-CP peers
        # share: the socket is named by the rank's place in its whole group.
        tp_rank, tp_size = rank_in_replica(cfg.tp_rank, cfg.tp_size)
        self.control = start_control(
            target, name=self.name, tp_rank=tp_rank, tp_size=tp_size, stage=(cfg.pp_rank, cfg.pp_size)
        )
        close_at_exit(self)  # not every SGLang owner of a storage backend closes it at exit

    def _on_event(self, event: kvplug.KVEvent) -> None:
        """The tiers' events: to the ``kvplug_on_event`` observers, and to the journal, which keeps
        only the pages some tier may still hold."""
        self.registry.emit(event)
        if self.target is not None:
            self.target.journal.on_event(event)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if str(host_pool_name) == PoolName.KV.value:
            self.register_mem_pool_host(host_pool)
        else:
            self._unsupported_pools.add(str(host_pool_name))
            logger.warning("KVPlugStorage stores only the kv pool; pool %r will always miss", str(host_pool_name))

    # --- keys and pages ---------------------------------------------------------------

    def storage_key(self, key: str) -> str:
        """kvplug's key of an SGLang page key: hex only, whatever SGLang sent."""
        self._check_ready()
        assert self.store is not None
        # Weights SGLang updated in place since it started (:func:`note_weight_update`) key
        # their pages apart: SGLang's page hash names tokens only, and its flush leaves L3 alone.
        generation = weights_generation()
        return self.store.key_prefix + kvplug.key_digest(f"{generation}:{key}" if generation else key).hex()

    def _fetch(self, keys: list[str]) -> list[torch.Tensor | None]:
        """Verified canonical pages of the leading keys some tier holds; ``None`` after a miss.

        The store verifies every page before any is promoted into a faster tier; a page
        that fails ends the prefix and is removed from every tier."""
        assert self.store is not None and self.page_format is not None
        store, dtype = self.store, self.page_format.dtype
        found: list[torch.Tensor | None] = [None] * len(keys)
        shapes = [self.page_format.canonical_shape] * len(keys)
        stored = [self.storage_key(k) for k in keys]
        loaded = self.reads.run(lambda: store.load_prefix(stored, shapes, dtype).tensors, None, "load")
        if loaded is None:  # given up: every page a miss, counted as vLLM's loads past their deadline are
            store.metrics.load_errors.labels("deadline").inc(len(keys))
            return found
        found[: len(loaded)] = loaded
        return found

    def _put(self, keys: list[str], pages: list[torch.Tensor]) -> bool:
        assert self.store is not None and self.page_format is not None
        if self._closed:
            return False  # a closed chain writes nothing: SGLang must not count these pages as backed up
        if not self.storage_config.is_storage_writer:
            return True  # another rank writes the replicated (MLA) pages
        items = [(self.storage_key(k), self.page_format.canonical(p)) for k, p in zip(keys, pages)]
        self.store.put_tensors(items)
        if self.target is not None:
            self.target.journal.stored([k for k, _ in items])
        return True

    def _host_page(self, host_indices: torch.Tensor, i: int) -> torch.Tensor:
        assert self.page_format is not None
        page: torch.Tensor = self.mem_pool_host.get_data_page(
            int(host_indices[i * self.page_format.indices_per_page]), flat=False
        )
        return page

    # --- generic interface ------------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Pages in the host pool's own flat order (what ``set_from_flat_data_page`` takes)."""
        self._check_ready()
        assert self.page_format is not None
        out: list[torch.Tensor | None] = []
        for index, page in enumerate(self._fetch(list(keys))):
            if page is None:
                out.append(None)
                continue
            target = target_locations[index] if target_locations is not None else None
            if target is None:
                target = torch.empty(self.page_format.page_shape, dtype=self.page_format.dtype)
            self.page_format.canonical(target).copy_(page)
            out.append(target.reshape(-1))
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        self._check_ready()
        if values is None or len(values) != len(keys):
            raise ValueError(
                f"batch_set needs one page per key: {len(keys)} keys, {0 if values is None else len(values)} values"
            )
        return self._put(list(keys), list(values))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages are stored (stops at the first missing one)."""
        self._check_ready()
        store = self.store
        assert store is not None
        stored = [self.storage_key(k) for k in keys]
        return self.reads.run(lambda: store.contains_prefix(stored), 0, "lookup")

    # --- zero-copy v1 (host indices) --------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Load pages straight into the host pool at ``host_indices`` (a logical page per key)."""
        self._check_ready()
        self._check_indices(keys, host_indices)
        assert self.page_format is not None
        results = []
        for index, page in enumerate(self._fetch(list(keys))):
            if page is not None:
                self.page_format.canonical(self._host_page(host_indices, index)).copy_(page)
            results.append(page is not None)
        return results

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        self._check_ready()
        self._check_indices(keys, host_indices)
        ok = self._put(list(keys), [self._host_page(host_indices, i) for i in range(len(keys))])
        return [ok] * len(keys)

    # --- v2 pool transfers ------------------------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """KV hits as in :meth:`batch_exists`; every other pool reports no pages."""
        hits = self.batch_exists(keys, extra_info)
        extra = {str(t.name): 0 for t in pool_transfers or [] if str(t.name) != PoolName.KV.value}
        return PoolTransferResult(kv_hit_pages=hits, extra_pool_hit_pages=extra)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {str(t.name): self._transfer(t, load=True, extra_info=extra_info) for t in transfers}

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return {str(t.name): self._transfer(t, load=False, extra_info=extra_info) for t in transfers}

    def _transfer(
        self, transfer: PoolTransfer, *, load: bool, extra_info: HiCacheStorageExtraInfo | None
    ) -> list[bool]:
        keys = list(transfer.keys or [])
        if str(transfer.name) != PoolName.KV.value:
            return [False] * len(keys)  # unsupported pool: a miss / a failed write, never wrong data
        if transfer.host_indices is None:
            raise ValueError("KVPlugStorage: a kv PoolTransfer needs host_indices")
        if load:
            return self.batch_get_v1(keys, transfer.host_indices, extra_info)
        return self.batch_set_v1(keys, transfer.host_indices, extra_info)

    # --- lifecycle --------------------------------------------------------------------

    def clear(self) -> None:
        """Remove the pages this backend wrote (in this process) from the tiers it wrote them to."""
        if self.target is not None:
            self.target.remove(self.target.every_page_written)

    def flush(self) -> None:
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        """Stop the control server (its socket file removed) and close the tiers, after
        their queued writes (waiting at most ``EXIT_WAIT_S``: SGLang closes a backend on its
        scheduler thread); a second call does nothing."""
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.store is not None and not self._closed:
            self._closed = True
            within_exit_wait(
                self.store.close, "closing the HiCache storage backend", self.store.chain.discard_queued_writes
            )

    def _check_ready(self) -> None:
        if self.store is None:
            raise RuntimeError("KVPlugStorage: register_mem_pool_host() must be called before storage operations")

    def _check_indices(self, keys: list[str], host_indices: torch.Tensor) -> None:
        assert self.page_format is not None
        need = len(keys) * self.page_format.indices_per_page
        if host_indices.numel() < need:
            raise ValueError(f"{len(keys)} pages need {need} host indices, got {host_indices.numel()}")


def _read_timeout(extra: dict[str, Any]) -> float:
    """``"read_timeout_s"`` of the extra config (:data:`READ_TIMEOUT_S` if absent)."""
    value = extra.get("read_timeout_s", READ_TIMEOUT_S)
    # Past threading.TIMEOUT_MAX a wait raises OverflowError (inf too): every read would fail.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= threading.TIMEOUT_MAX:
        raise ValueError(
            "--hicache-storage-backend-extra-config: read_timeout_s must be a number of seconds > 0"
            f" and at most {threading.TIMEOUT_MAX:g}, got {value!r}"
        )
    return float(value)
