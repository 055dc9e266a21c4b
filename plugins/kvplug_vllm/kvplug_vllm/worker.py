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
whose load failed stores nothing until vLLM rolled it back: its later blocks were
computed on top of the bad ones (:mod:`kvplug_vllm.load_results`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import time
import weakref
from collections.abc import Callable, Generator, Mapping
from typing import Any

import torch

from kvplug import (
    CacheEngine,
    ChunkKey,
    ControlServer,
    EngineControl,
    load_config,
    slots_from_block_ids,
)
from kvplug_vllm.background import BackgroundLoads
from kvplug_vllm.control import HybridControl, reset_tiers, start_control
from kvplug_vllm.group_engines import GroupEngines
from kvplug_vllm.kv_events import ChunkIndex, KVPlugKVEvents
from kvplug_vllm.kv_groups import KVGroup, check_block_size, primary_group
from kvplug_vllm.layerwise_step import LayerwiseStep
from kvplug_vllm.layout import check_chunk_size, detect_layout, fingerprint_for, head_shard
from kvplug_vllm.load_results import LoadResults, sum_over
from kvplug_vllm.lookup import LocalWorker, register_local, unregister_local
from kvplug_vllm.metadata import KVPlugConnectorMetadata, RequestMeta
from kvplug_vllm.settings import ConnectorSettings
from kvplug_vllm.stats import KVPlugConnectorStats
from kvplug_vllm.worker_loads import load_now, write_background_loads
from kvplug_vllm.worker_stats import pass_engine_metrics, serve_metrics, stop_serving_metrics, timed

logger = logging.getLogger("kvplug.vllm")

#: Longest wait for a background load in a step that computes nothing: short enough that
#: a request arriving meanwhile is scheduled at once, long enough to stop the busy loop.
IDLE_WAIT_S = 0.005


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
        #: Steps vLLM runs at once (async scheduling, pipeline parallelism): how long a bad block stays bad.
        self.results = LoadResults(int(getattr(vllm_config, "max_concurrent_batches", 2)))
        #: A sum over the tensor-parallel ranks (None at TP 1), for their agreement on failed loads.
        self.all_ranks: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._layers = LayerwiseStep()
        self._stats = KVPlugConnectorStats()
        self._metric_marks: dict[str, float] = {}
        self._first_rank = True  # tensor- and pipeline-parallel rank 0: counts the engine's tokens
        self._busy_s = 0.0
        self._worked = False
        self._metrics_server: Any = None
        self.background = BackgroundLoads(settings.load_timeout_s)
        self.index: ChunkIndex | None = None
        #: A hybrid model's KV cache groups, each with its own engine and caches (see kv_groups.py);
        #: empty for one group. Their loads run in the background and fail by request.
        self.kv_groups = list(kv_groups or [])
        self.groups: GroupEngines | None = None
        self.layerwise = settings.layerwise and len(self.kv_groups) <= 1

    # --- setup ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank, get_tp_group

        # A hybrid model's primary group is this worker's own engine (its chunks answer
        # lookups); GroupEngines serves the others from the full ``kv_caches``.
        several = len(self.kv_groups) > 1
        primary = primary_group(self.kv_groups)
        caches = {name: kv_caches[name] for name in self.kv_groups[primary].layer_names} if several else kv_caches
        layout = detect_layout(caches, self.vllm_config)
        if self.kv_groups:
            check_block_size(self.kv_groups[primary], layout.block_size)
        config = load_config(engine_extra=self.engine_extra).config
        check_chunk_size(layout, config.chunk_size)
        ranks = dict(tp_rank=get_tensor_model_parallel_rank(), pp_rank=get_pp_group().rank_in_group)
        self._first_rank = not any(ranks.values())
        group = self.kv_groups[primary].describe(len(self.kv_groups)) if several else ""
        fingerprint = fingerprint_for(layout, self.vllm_config, kv_group=group, **ranks)
        self.kv_caches = list(caches.values())
        self.layer_index = {name: index for index, name in enumerate(caches)}
        tp_group = get_tp_group()
        self.all_ranks = sum_over(tp_group.cpu_group) if tp_group.world_size > 1 else None
        heads = head_shard(layout, self.vllm_config, config.heads_per_record, tp_rank=ranks["tp_rank"])
        self.engine = CacheEngine(config, layout, fingerprint, heads=heads)
        if several:
            primary_entry = (primary, self.engine, self.kv_caches)
            self.groups = GroupEngines(self.kv_groups, primary_entry, kv_caches, config, self.vllm_config, **ranks)
        trim = self.groups.trim if self.groups is not None else None
        kv_events = getattr(self.vllm_config, "kv_events_config", None)
        # The first rank alone publishes: vLLM publishes an event only when every worker that
        # reported events in a step reported it, and the ranks' tier writes land in different
        # steps, so events of several ranks were published early or never (see kv_events.py).
        if kv_events is not None and kv_events.enable_kv_cache_events and self._first_rank:
            self.index = ChunkIndex(layout.block_size, [t.type for t in config.tiers], self.engine.writes_in_flight)
            self.engine.add_event_listener(self.index.on_event)
        register_local(self.engine_key, LocalWorker(self.engine, self.reset_cache, trim))
        #: What this worker stored and loaded, and where its writes went: kvplug ctl's target and the reset's plan.
        self.target = EngineControl(self.engine) if self.groups is None else HybridControl(self.engine, self.groups)
        # Also the socket a scheduler in another process looks up and resets this worker's cache on.
        self.control = start_control(self.target, self.vllm_config, self.engine_key, on_reset=self.reset_cache)
        if self.settings.metrics_port is not None:
            self._metrics_server = serve_metrics(self.settings.metrics_port + self.engine_key[2], self.engine)
        _close_at_exit(self)
        logger.info(
            "kvplug cache engine ready: layout %s (%s), chunk %d tokens, tiers %s, layerwise %s, fingerprint %s",
            layout.describe(), fingerprint.engine_variant, config.chunk_size, [t.type for t in config.tiers],
            self.settings.layerwise, self.engine.fingerprint.hexdigest(),
        )  # fmt: skip

    # --- per step ---------------------------------------------------------------------

    def begin_step(self) -> None:
        """Reset per-step state; vLLM binds new metadata before every forward."""
        self.results.begin_step()
        self._layers = LayerwiseStep()
        meta = self._metadata()
        if meta is not None:
            # Before this step's loads and stores, not in get_finished after them: vLLM may
            # already reuse a finished request's id for a new request in this step.
            self.results.forget(set(meta.finished_req_ids))

    @timed
    def start_load_kv(self) -> None:
        meta = self._metadata()
        if self.engine is None or meta is None or not self.can_load:
            return
        for request in meta.requests:
            if request.load is None:
                continue
            if request.load.background:
                keys = self._hit_keys(request)
                if self.groups is not None:
                    self.background.start_fetch(request, functools.partial(self.groups.fetch, request))
                else:
                    self.background.start(self.engine, request, self.kv_caches, keys)
            else:
                self._load(request)

    def _load(self, request: RequestMeta) -> None:
        assert self.engine is not None and request.load is not None
        self._worked = True
        layers = self._layers if self.layerwise else None
        load_now(self.engine, request, self.kv_caches, self._hit_keys(request), layers, self.results, self._stats)

    def _hit_keys(self, request: RequestMeta) -> list[ChunkKey] | None:
        """The keys of the chunks ``request`` loads (:meth:`_remember` of its hit)."""
        assert request.load is not None
        return self._remember(request, request.token_ids[: request.load.num_hit], request.load.num_computed, True)

    @timed
    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self.layer_index.get(layer_name)
        if index is not None and self._layers.loads:
            self._layers.load_through(index)

    @timed
    def save_kv_layer(self, layer_name: str) -> None:
        if not self.layerwise or self.engine is None:
            return
        index = self.layer_index.get(layer_name)
        if index is None:
            return
        if index == 0 and not self._layers.storing:
            storers = (
                (request.req_id, self._store(request, layerwise=True)) for request in self._to_save(self._metadata())
            )
            self._layers.stores = [(req_id, s) for req_id, s in storers if s is not None]
            self._layers.storing = True
        self._layers.store_through(index)

    @timed
    def wait_for_save(self) -> None:
        if self.engine is None:
            return
        self._layers.finish_loads(self.results, self.engine.layout.block_size, self._stats)
        meta = self._metadata()
        if (
            meta is not None
            and self.all_ranks is not None
            and any(r.load is not None and not r.load.background for r in meta.requests)
        ):  # the same metadata on every rank: all of them, or none, take part
            self.results.agree(meta.requests, self.all_ranks)
        requests, elsewhere = (meta.requests, meta.computed_blocks) if meta is not None else ([], [])
        self.results.refuse_sharers(requests, self.engine.layout.block_size, elsewhere)
        if self.layerwise:
            self._layers.finish_stores(self.results.failed_this_step)
            return
        for request in self._to_save(meta):
            self._store(request, layerwise=False)

    def _to_save(self, meta: KVPlugConnectorMetadata | None) -> list[RequestMeta]:
        if meta is None or not self.can_save:
            return []
        return [r for r in meta.requests if (r.save_end > r.save_start or r.state_blocks) and self.results.may_store(r)]

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
        return self.results.take_failed_requests()

    # --- outputs ----------------------------------------------------------------------

    @timed
    def get_finished(self, finished_req_ids: set[str] | None = None) -> set[str] | None:
        """Requests whose background load finished, failed or ran past its deadline this step.

        Finished fetches are written into the paged cache here, on vLLM's thread
        between two forward passes; the blocks of failed or late ones are reported
        as load errors in the same step, as vLLM requires. ``finished_req_ids`` were
        forgotten as the step began (:meth:`begin_step`, from the metadata).
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
        groups = self.groups is not None
        timeout_s = self.background.timeout_s
        if write_background_loads(done, self.engine, self.results, self._stats, timeout_s=timeout_s, groups=groups):
            self._worked = True
        return {request.req_id for request, _, _ in done} or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.results.take_block_errors()

    def _remember(
        self, request: RequestMeta, tokens: list[int], start: int, loading: bool = False
    ) -> list[ChunkKey] | None:
        """Index the chunks of ``tokens`` from ``start`` on (keys -> vLLM blocks), for KV events;
        returns every chunk key of ``tokens`` (a load of them reuses them). ``loading``: the
        tokens are the load's hit, whose chunk hashes its lookup found (not hashed again), and
        whose keys the load needs even where no KV events are published."""
        if self.engine is None or (self.index is None and not loading):
            return None
        load = request.load
        hashes = load.chunk_hashes if loading and load is not None and len(tokens) == load.num_hit else None
        keys = self.engine.chunk_keys(tokens, request.request_info(), hashes=hashes)
        if self.index is not None:
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
        """vLLM's reset_prefix_cache: this worker's chunks leave the ``reset_tiers`` tiers
        (:func:`kvplug_vllm.control.reset_tiers`); returns how many records went."""
        if self.engine is None or self.target is None:
            return 0
        return reset_tiers(self.engine, self.target, self.settings.reset_tiers)

    def get_kv_connector_stats(self) -> KVPlugConnectorStats | None:
        if self.engine is not None:
            pass_engine_metrics(self._stats, self.engine, self._metric_marks, first_rank=self._first_rank)
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
            self.control.close()  # and its target
            self.control = None
        elif self.target is not None:  # no control server started: the target is this worker's to close
            self.target.close()
        self.target = None
        if self._metrics_server is not None:
            stop_serving_metrics(self._metrics_server)
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
