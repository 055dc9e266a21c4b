"""Worker side of the connector: owns the cache engine, loads and stores blocks.

Loads are synchronous from vLLM's point of view: ``start_load_kv`` runs before
the forward pass of a step with loads and fetches (and checksums) every promised
chunk. Whole mode writes them at once; layer-wise mode writes layer ``l`` in
``wait_for_layer_load(l)``, just before that layer's attention reads it.
Stores copy the finished blocks out in ``wait_for_save`` (after the forward) or,
layer-wise, in ``save_kv_layer`` right after each layer's attention; the tiers
are written by the cache engine's store thread.

Blocks the scheduler was promised but that did not load (missing, corrupt, tier
down) are reported by ``get_block_ids_with_load_errors``; vLLM then recomputes
them (``kv_load_failure_policy: recompute``) or fails the request. A request
whose load failed stores nothing in that step: its later blocks were computed
on top of the bad ones.
"""

from __future__ import annotations

import atexit
import functools
import logging
import time
import weakref
from collections.abc import Callable, Generator, Mapping
from typing import Any, TypeVar

import torch

from kvplug import (
    CacheEngine,
    ChunkKey,
    ControlServer,
    EngineControl,
    LayerwiseRetrieve,
    MetricSample,
    load_config,
    slots_from_block_ids,
)
from kvplug.errors import ConfigError, ConfigProblem
from kvplug_vllm.background import BackgroundLoads, GroupsRetrieve, fetch
from kvplug_vllm.control import HybridControl, start_control
from kvplug_vllm.group_engines import GroupEngines
from kvplug_vllm.kv_events import ChunkIndex, KVPlugKVEvents
from kvplug_vllm.kv_groups import KVGroup, first_real_token, primary_group
from kvplug_vllm.layout import detect_layout, fingerprint_for, head_shard
from kvplug_vllm.lookup import LocalWorker, register_local, unregister_local
from kvplug_vllm.metadata import KVPlugConnectorMetadata, RequestMeta
from kvplug_vllm.settings import ConnectorSettings, resets
from kvplug_vllm.stats import GAUGE_PREFIX, LOAD_ERROR_PREFIX, KVPlugConnectorStats

logger = logging.getLogger("kvplug.vllm")

#: kvplug metric -> connector stats counter reported each step as a difference.
_METRIC_COUNTERS = {
    "kvplug_loaded_tokens_total": "loaded_tokens",
    "kvplug_loaded_bytes_total": "loaded_bytes",
    "kvplug_stored_tokens_total": "stored_tokens",
    "kvplug_stored_bytes_total": "stored_bytes",
}


#: Labelled kvplug metrics passed on by label: metric -> (its label, connector stats key prefix).
_LABELLED = {
    "kvplug_load_errors_total": ("reason", LOAD_ERROR_PREFIX),
    "kvplug_store_dropped_total": ("queue", "store_dropped."),
    "kvplug_remote_breaker_state": ("tier", GAUGE_PREFIX + "breaker_state."),
    "kvplug_pinned_bytes": ("tier", GAUGE_PREFIX + "pinned_bytes."),
    "kvplug_pins_refused_total": ("tier", "pins_refused."),
    "kvplug_quota_evictions_total": ("tier", "quota_evictions."),
}
#: Per-tenant metrics (labels tier and tenant) -> connector stats key prefix; ``<tier>|<tenant>`` follows
#: (a tier label, ``<index>:<type>``, has no ``|``).
_TENANT_LABELLED = {
    "kvplug_tenant_bytes": GAUGE_PREFIX + "tenant_bytes.",
    "kvplug_tenant_hits_total": "tenant_hits.",
}
#: Per-tier counters with a reason -> connector stats key prefix; ``<tier>|<reason>`` follows.
_REASON_LABELLED = {"kvplug_stores_refused_total": "stores_refused."}


def _stats_name(sample: MetricSample) -> str | None:
    """The connector stats key a kvplug metric sample is reported under, or None."""
    if not sample.labels:
        return _METRIC_COUNTERS.get(sample.name)
    if sample.name in _LABELLED:
        label, prefix = _LABELLED[sample.name]
        if set(sample.labels) == {label}:
            return prefix + sample.labels[label]
    if sample.name in _TENANT_LABELLED and set(sample.labels) == {"tier", "tenant"}:
        return f"{_TENANT_LABELLED[sample.name]}{sample.labels['tier']}|{sample.labels['tenant']}"
    if sample.name in _REASON_LABELLED and set(sample.labels) == {"tier", "reason"}:
        return f"{_REASON_LABELLED[sample.name]}{sample.labels['tier']}|{sample.labels['reason']}"
    return None


#: Longest wait for a background load in a step that computes nothing: short enough that
#: a request arriving meanwhile is scheduled at once, long enough to stop the busy loop.
IDLE_WAIT_S = 0.005

_F = TypeVar("_F", bound=Callable[..., Any])


def _timed(method: _F) -> _F:
    """Count the method's wall time as connector time on the forward pass (``worker_us``)."""

    @functools.wraps(method)
    def wrapper(self: WorkerSide, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy_s += time.perf_counter() - started

    return wrapper  # type: ignore[return-value]


class WorkerSide:
    """The worker-role half of :class:`kvplug_vllm.KVPlugConnector`."""

    def __init__(
        self,
        parent: Any,
        vllm_config: Any,
        settings: ConnectorSettings,
        engine_extra: Mapping[str, Any],
        engine_key: tuple[str, int, int],
        *,
        kv_groups: list[KVGroup] | None = None,
    ) -> None:
        kv_transfer = vllm_config.kv_transfer_config
        self._parent = parent
        self.vllm_config = vllm_config
        self.settings = settings
        self.engine_extra = dict(engine_extra)
        self.engine_key = engine_key
        self.can_load = kv_transfer.is_kv_consumer
        self.can_save = kv_transfer.is_kv_producer
        self.engine: CacheEngine | None = None
        self.control: ControlServer | None = None
        self.target: EngineControl | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.layer_index: dict[str, int] = {}
        self._load_errors: set[int] = set()
        self._failed_requests: set[str] = set()
        self._retrievers: list[LayerwiseRetrieve] = []
        self._loaded_layers = 0
        self._storers: list[Generator[int, None, int]] = []
        self._saved_layers = 0
        self._stats = KVPlugConnectorStats()
        self._metric_marks: dict[str, float] = {}
        self._busy_s = 0.0
        self._worked = False
        self._metrics_server: Any = None
        self.background = BackgroundLoads(settings.load_timeout_ms / 1000)
        self.index: ChunkIndex | None = None
        #: A hybrid model's KV cache groups, each with its own engine and caches (see kv_groups.py);
        #: empty for one group. Their loads run in the background and fail by request.
        self.kv_groups = list(kv_groups or [])
        self.groups: GroupEngines | None = None
        self._failed_loads: set[str] = set()
        self.layerwise = settings.layerwise and len(self.kv_groups) <= 1

    # --- setup ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        all_caches = kv_caches
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        if len(self.kv_groups) > 1:
            primary = self.kv_groups[primary_group(self.kv_groups)]
            kv_caches = {name: kv_caches[name] for name in primary.layer_names}
        layout = detect_layout(kv_caches, self.vllm_config)
        config = load_config(engine_extra=self.engine_extra).config
        if layout.whole_blocks_only and config.chunk_size % layout.block_size:
            raise ConfigError(
                [
                    ConfigProblem(
                        "chunk_size",
                        config.chunk_size,
                        f"must be a multiple of vLLM's block size {layout.block_size}: "
                        f"the {layout.format.name} layout copies whole blocks only",
                    )
                ],
                "kv_connector_extra_config",
            )
        ranks = dict(tp_rank=get_tensor_model_parallel_rank(), pp_rank=get_pp_group().rank_in_group)
        count = len(self.kv_groups)
        group = self.kv_groups[primary_group(self.kv_groups)].describe(count) if count > 1 else ""
        fingerprint = fingerprint_for(layout, self.vllm_config, kv_group=group, **ranks)
        self.kv_caches = list(kv_caches.values())
        self.layer_index = {name: index for index, name in enumerate(kv_caches)}
        tp_rank = get_tensor_model_parallel_rank()
        heads = head_shard(layout, self.vllm_config, config.heads_per_record, tp_rank=tp_rank)
        self.engine = CacheEngine(config, layout, fingerprint, heads=heads)
        if count > 1:
            primary_entry = (primary_group(self.kv_groups), self.engine, self.kv_caches)
            self.groups = GroupEngines(self.kv_groups, primary_entry, all_caches, config, self.vllm_config, **ranks)
        trim = self.groups.trim if self.groups is not None else None
        kv_events = getattr(self.vllm_config, "kv_events_config", None)
        self.index = ChunkIndex(
            layout.block_size,
            [t.type for t in config.tiers],
            publish=bool(kv_events is not None and kv_events.enable_kv_cache_events),
        )
        self.engine.add_event_listener(self.index.on_event)
        register_local(self.engine_key, LocalWorker(self.engine, self.reset_cache, trim))
        #: What this worker stored and loaded, and where its writes went: kvplug ctl's target and the reset's plan.
        self.target = EngineControl(self.engine) if self.groups is None else HybridControl(self.engine, self.groups)
        # Also the socket a scheduler in another process looks up and resets this worker's cache on.
        self.control = start_control(self.target, self.vllm_config, self.engine_key, on_reset=self.reset_cache)
        if self.settings.metrics_port is not None:
            from prometheus_client import start_http_server

            port = self.settings.metrics_port + self.engine_key[2]
            self._metrics_server = start_http_server(port, addr="127.0.0.1", registry=self.engine.metrics.registry)
            logger.info("kvplug metrics on http://127.0.0.1:%d/metrics", port)
        _close_at_exit(self)
        logger.info(
            "kvplug cache engine ready: layout %s (%s), chunk %d tokens, tiers %s, layerwise %s, fingerprint %s",
            layout.describe(), fingerprint.engine_variant, config.chunk_size, [t.type for t in config.tiers],
            self.settings.layerwise, self.engine.fingerprint.hexdigest(),
        )  # fmt: skip

    # --- per step ---------------------------------------------------------------------

    def begin_step(self) -> None:
        """Reset per-step state; vLLM binds new metadata before every forward."""
        self._failed_requests.clear()
        self._retrievers = []
        self._loaded_layers = 0
        self._storers = []
        self._saved_layers = 0

    @_timed
    def start_load_kv(self) -> None:
        meta = self._metadata()
        if self.engine is None or meta is None or not self.can_load:
            return
        for request in meta.requests:
            if request.load is None:
                continue
            if request.load.background:
                keys = self._remember(
                    request, request.token_ids[: request.load.num_hit], request.load.num_computed, True
                )
                if self.groups is not None:
                    self.background.start_fetch(request, functools.partial(self.groups.fetch, request))
                else:
                    self.background.start(self.engine, request, self.kv_caches, keys)
            else:
                self._load(request)

    def _load(self, request: RequestMeta) -> None:
        assert self.engine is not None and request.load is not None
        self._worked = True
        started = time.perf_counter()
        tokens = request.token_ids[: request.load.num_hit]
        keys = self._remember(request, tokens, request.load.num_computed, True)
        try:
            retriever = fetch(self.engine, request, self.kv_caches, keys)
            if self.layerwise:
                self._retrievers.append(retriever)
            else:
                retriever.write_remaining()
                self._count_phases(retriever)
            loaded = retriever.loaded_mask
        except Exception:
            logger.exception("request %s: loading failed; its blocks will be recomputed", request.req_id)
            loaded = torch.zeros(len(tokens), dtype=torch.bool)
        self._stats.sample("load_seconds", time.perf_counter() - started)
        self._check_loaded(request, loaded)

    def _count_phases(self, retriever: LayerwiseRetrieve | GroupsRetrieve) -> None:
        """Where a load's time went (tier reads, verify, writing into vLLM's blocks), for the breakdown of a hit."""
        timings = retriever.timings
        self._stats.add(
            load_fetch_us=int(timings.fetch_s * 1e6),
            load_verify_us=int(timings.verify_s * 1e6),
            load_write_us=int(timings.write_s * 1e6),
        )

    def _check_loaded(self, request: RequestMeta, loaded: torch.Tensor | None) -> None:
        """Report the promised blocks that did not load (``loaded`` None: none did)."""
        assert self.engine is not None and request.load is not None
        load = request.load
        block_size = self.engine.layout.block_size
        if loaded is None:
            loaded = torch.zeros(load.num_hit, dtype=torch.bool)
        end = load.num_computed + load.num_external
        start = max(load.num_computed, first_real_token(request.block_ids, block_size))  # none before the window
        bad: set[int] = set()
        for block in range(start // block_size, -(-end // block_size)):
            lo, hi = max(start, block * block_size), min(end, (block + 1) * block_size)
            if not bool(loaded[lo:hi].all()):
                bad.add(request.block_ids[block])
        if bad:
            self._load_errors |= bad
            self._failed_requests.add(request.req_id)
            self._stats.add(load_error_blocks=len(bad), load_error_requests=1)
            logger.warning(
                "request %s: %d of %d promised tokens did not load; reporting %d blocks for recompute",
                request.req_id, int((~loaded[start:end]).sum()), end - start, len(bad),
            )  # fmt: skip

    @_timed
    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self.layer_index.get(layer_name)
        if index is None or not self._retrievers:
            return
        while self._loaded_layers <= index:
            for retriever in self._retrievers:
                next(retriever, None)
            self._loaded_layers += 1

    @_timed
    def save_kv_layer(self, layer_name: str) -> None:
        if not self.layerwise or self.engine is None:
            return
        index = self.layer_index.get(layer_name)
        if index is None:
            return
        if index == 0 and self._saved_layers == 0:
            meta = self._metadata()
            storers = (self._store(request, layerwise=True) for request in self._to_save(meta))
            self._storers = [s for s in storers if s is not None]
        while self._saved_layers <= index:
            for storer in self._storers:
                next(storer, None)
            self._saved_layers += 1

    @_timed
    def wait_for_save(self) -> None:
        if self.engine is None:
            return
        for retriever in self._retrievers:  # layers the forward pass did not wait for
            retriever.write_remaining()
        self._retrievers = []
        if self.layerwise:
            for storer in self._storers:
                for _ in storer:
                    pass
            self._storers = []
            return
        for request in self._to_save(self._metadata()):
            self._store(request, layerwise=False)

    def _to_save(self, meta: KVPlugConnectorMetadata | None) -> list[RequestMeta]:
        if meta is None or not self.can_save:
            return []
        return [
            r
            for r in meta.requests
            if (r.save_end > r.save_start or r.state_blocks) and r.req_id not in self._failed_requests
        ]

    def _store(self, request: RequestMeta, *, layerwise: bool) -> Generator[int, None, int] | None:
        assert self.engine is not None
        self._worked = True
        tokens = request.token_ids[: request.save_end]
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[: request.save_start] = False
        try:
            self._remember(request, tokens, request.save_start)
            if self.groups is not None:
                started = time.perf_counter()
                self.groups.store(request, tokens)
                self._stats.sample("store_seconds", time.perf_counter() - started)
                return None
            slots = slots_from_block_ids(request.block_ids, self.engine.layout.block_size, len(tokens))
            if layerwise:
                return self.engine.store_layerwise(tokens, self.kv_caches, slots, mask, request=request.request_info())
            started = time.perf_counter()
            self.engine.store(tokens, self.kv_caches, slots, mask, request=request.request_info())
            self._stats.sample("store_seconds", time.perf_counter() - started)
        except Exception:
            logger.exception("request %s: storing failed; nothing stored for this step", request.req_id)
        return None

    def take_failed_loads(self) -> set[str]:
        """Requests of a hybrid model whose background load failed (vLLM recomputes them whole)."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    # --- outputs ----------------------------------------------------------------------

    @_timed
    def get_finished(self) -> set[str] | None:
        """Requests whose background load finished, failed or ran past its deadline this step.

        Finished fetches are written into the paged cache here, on vLLM's thread
        between two forward passes; the blocks of failed or late ones are reported
        as load errors in the same step, as vLLM requires.
        """
        if self.engine is None:
            return None
        meta = self._metadata()
        if meta is not None and meta.idle:
            # Nothing to compute this step: vLLM would call again at once, a busy loop
            # that holds the GIL and starves the threads moving the KV in (a 12 MiB
            # valkey read ran past its deadline that way). Waiting here releases it.
            self.background.wait(IDLE_WAIT_S)
        done = self.background.collect()
        for request, retriever, seconds in done:
            self._stats.sample("load_seconds", seconds)
            if retriever is None:
                reason = "deadline" if seconds >= self.background.timeout_s else "fetch_failed"
                self._stats.add(**{LOAD_ERROR_PREFIX + reason: 1})
            loaded = None
            if retriever is not None:
                self._worked = True
                try:
                    retriever.write_remaining()
                    self._count_phases(retriever)
                    loaded = None if isinstance(retriever, GroupsRetrieve) else retriever.loaded_mask
                except Exception:
                    logger.exception(
                        "request %s: writing the loaded KV failed; its blocks will be recomputed", request.req_id
                    )
            if isinstance(retriever, GroupsRetrieve) or (retriever is None and self.groups is not None):
                self._check_groups_loaded(request, retriever)
            else:
                self._check_loaded(request, loaded)
        return {request.req_id for request, _, _ in done} or None

    def _check_groups_loaded(self, request: RequestMeta, retriever: GroupsRetrieve | None) -> None:
        """A hybrid model's load counts whole or not at all: vLLM recomputes a failed one from scratch."""
        assert request.load is not None
        if retriever is not None and retriever.complete(request.load.num_computed + request.load.num_external):
            return
        self._failed_loads.add(request.req_id)
        self._stats.add(load_error_requests=1)
        logger.warning("request %s: a KV cache group did not load; vLLM recomputes the request", request.req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _remember(
        self, request: RequestMeta, tokens: list[int], start: int, loading: bool = False
    ) -> list[ChunkKey] | None:
        """Index the chunks of ``tokens`` from ``start`` on (keys -> vLLM blocks), for KV events;
        returns every chunk key of ``tokens`` (a load of them reuses them). ``loading``: the
        tokens are the load's hit, whose chunk hashes its lookup found (not hashed again)."""
        if self.index is None or self.engine is None:
            return None
        load = request.load
        hashes = load.chunk_hashes if loading and load is not None and len(tokens) == load.num_hit else None
        keys = self.engine.chunk_keys(tokens, request.request_info(), hashes=hashes)
        self.index.remember([k for k in keys if k.end > start], tokens, request.block_hashes, request.lora_id)
        return keys

    def get_kv_cache_events(self) -> KVPlugKVEvents | None:
        if self.index is None:
            return None
        events = self.index.take()
        if not events:
            return None
        batch = KVPlugKVEvents(num_workers=1)
        batch.add_events(events)
        return batch

    def reset_cache(self) -> int:
        """Remove this worker's chunks, of every KV cache group, from the ``reset_tiers`` tiers (by
        default the in-memory ones, told by their ``medium``); returns how many records went.

        As ``kvplug ctl clear``: from a private tier (``trusted_reads``: this process's memory) every
        chunk the worker stored or loaded; from a tier other engines may share (``shm``) only the
        records this worker's writes put there, never what another engine wrote."""
        if self.engine is None or self.target is None:
            return 0
        plan = self.target.planned_clear()
        removed: set[str] = set()
        for index, tier in enumerate(self.engine.chain.tiers):
            if not resets(tier, self.settings.reset_tiers):
                continue
            keys = plan.for_tier(index, private=tier.trusted_reads)
            try:
                tier.remove(keys)
            except Exception:
                logger.exception("reset_cache: removing chunks from tier %s failed", tier.name)
                continue
            removed.update(keys)
        return len(removed)

    def get_kv_connector_stats(self) -> KVPlugConnectorStats | None:
        if self.engine is not None:
            for sample in self.engine.metrics.samples():
                name = _stats_name(sample)
                if name is None or sample.value == self._metric_marks.get(name, 0.0):
                    continue
                if name.startswith(GAUGE_PREFIX):
                    self._stats.data[name] = sample.value
                else:
                    self._stats.add(**{name: int(sample.value - self._metric_marks.get(name, 0.0))})
                self._metric_marks[name] = sample.value
        if self._worked:  # time of steps that moved KV; idle steps' few microseconds wait for one
            self._stats.add(worker_us=int(self._busy_s * 1e6))
            self._busy_s, self._worked = 0.0, False
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVPlugConnectorStats()
        return stats

    def shutdown(self) -> None:
        """Stop the control server and close the cache engine, writing queued stores."""
        self.background.close()
        if self.control is not None:
            self.control.close()
            self.control = None
        if self._metrics_server is not None:
            httpd, thread = self._metrics_server
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=10)
            self._metrics_server = None
        if self.groups is not None and self.engine is not None:
            self.groups.close(self.engine)
        self.groups = None
        if self.engine is not None:
            unregister_local(self.engine_key)
            if self.index is not None:
                self.engine.remove_event_listener(self.index.on_event)
            self.engine.close(drain=True)
            self.engine = None

    def _metadata(self) -> KVPlugConnectorMetadata | None:
        if not self._parent.has_connector_metadata():
            return None
        meta = self._parent._get_connector_metadata()
        return meta if isinstance(meta, KVPlugConnectorMetadata) else None


def _close_at_exit(worker: WorkerSide) -> None:
    """Write queued stores even if vLLM exits without calling ``shutdown``."""
    ref = weakref.ref(worker)

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.shutdown()

    atexit.register(close)
