"""``KVPlugConnector``: a vLLM v1 KV connector backed by kvplug's ``CacheEngine``.

vLLM creates one instance per role: the scheduler's (lookups, per-step
metadata) and each worker's (owns the cache engine, copies blocks). This class
only dispatches to :class:`~kvplug_vllm.scheduler.SchedulerSide` and
:class:`~kvplug_vllm.worker.WorkerSide`.

Enable it with ``--kv-transfer-config '{"kv_connector": "KVPlugConnector",
"kv_role": "kv_both", "kv_connector_extra_config": {"kvplug.config": "kvplug.yaml"}}'``
(the ``vllm.general_plugins`` entry point registers the name), or name this
module in ``kv_connector_module_path``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvplug import load_config
from kvplug_vllm.kv_events import KVPlugKVEvents
from kvplug_vllm.kv_groups import check_kv_cache_groups
from kvplug_vllm.prom_metrics import KVPlugPromMetrics
from kvplug_vllm.scheduler import SchedulerSide
from kvplug_vllm.settings import split_extra_config
from kvplug_vllm.sleep import CacheSleep
from kvplug_vllm.stats import KVPlugConnectorStats
from kvplug_vllm.weights import watch_reloads
from kvplug_vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvplug.vllm")


class KVPlugConnector(KVConnectorBase_V1, SupportsHMA):
    """Stores prompt KV in kvplug's tiers and loads cached prefixes back (LMCache semantics).

    It keeps vLLM's hybrid KV cache manager on (``SupportsHMA``): each KV cache group
    (full attention, sliding window) is stored and loaded with its own block ids
    (:mod:`kvplug_vllm.kv_groups`); groups it cannot serve are refused at start-up.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _route_logs_to_vllm()
        groups = check_kv_cache_groups(vllm_config, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER and (len(groups) > 1 or any(g.sliding_window for g in groups)):
            logger.info(
                "model %s: KV cache groups %s (vLLM's hybrid allocator); kvplug stores and loads each group with "
                "its own block ids", vllm_config.model_config.model, ", ".join(g.describe(len(groups)) for g in groups),
            )  # fmt: skip
        settings, engine_extra = split_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self.settings = settings
        parallel = vllm_config.parallel_config
        worker = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            # each pipeline stage's workers have tensor-parallel ranks 0.. of their own (lookup.py)
            worker = get_pp_group().rank_in_group * parallel.tensor_parallel_size + get_tensor_model_parallel_rank()
        engine_key = (str(self._kv_transfer_config.engine_id), parallel.data_parallel_rank, worker)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._sleep = CacheSleep()
        if role == KVConnectorRole.SCHEDULER:
            config = load_config(engine_extra=engine_extra).config
            if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") == "fail":
                logger.warning(
                    "kv_load_failure_policy is 'fail' (vLLM's default): a cached chunk that cannot be loaded "
                    "(a corrupt record, a store that went away) fails its request; set "
                    '"kv_load_failure_policy": "recompute" so vLLM computes it instead'
                )
            self._scheduler = SchedulerSide(
                vllm_config,
                settings,
                config,
                engine_key,
                num_kv_cache_groups=len(groups),
                state_groups=any(g.kind == "state" for g in groups),
            )
        else:
            self._worker = WorkerSide(self, vllm_config, settings, engine_extra, engine_key, kv_groups=groups)

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache is best effort: a finished request never waits for its KV to be stored.
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        settings, _ = split_extra_config(extra_config)
        return settings.layerwise

    # --- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)
        watch_reloads(self._worker_side())  # vLLM reloading the weights in place says nothing to a connector

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # Every copy follows the caches through unregister/restore (kvplug_vllm.sleep).
        return True

    def unregister_kv_caches(self) -> None:
        """Before vLLM's sleep: no copy touches the caches until they are restored."""
        if self._worker is not None:
            self._sleep.unregister(self._worker)

    def restore_kv_caches(self, kv_caches: dict[str, torch.Tensor] | None = None) -> None:
        """After wake-up: copy through the caches again (``kv_caches``: new tensors by layer name, if remapped)."""
        if self._worker is not None:
            self._sleep.restore(self._worker, kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.begin_step()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_side().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker_side().save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker_side().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self._worker_side().get_finished(finished_req_ids)  # stores never hold blocks; background loads do

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # A hybrid model's load failures go by request: vLLM maps block ids to requests
        # for one KV cache group only (they are unique within a group).
        _, finished = self.get_finished(finished_req_ids)
        failed = self._worker_side().take_failed_loads()
        return KVConnectorTransferResults(finished_recving=set(finished or ()) | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> KVPlugKVEvents | None:
        return self._worker_side().get_kv_cache_events()

    # --- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Stores are copied out in the step that computed them: no group's blocks are held.
        return self._scheduler_side().request_finished(request, list(block_ids[0]) if block_ids else [])

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler_side().take_events()

    def reset_cache(self) -> bool | None:
        return self._scheduler_side().reset_cache()

    # --- both -----------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._scheduler if self._scheduler is not None else self._worker
        return side.get_kv_connector_stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPlugConnectorStats(data=dict(data)) if data is not None else KVPlugConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVPlugPromMetrics:
        return KVPlugPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side connector method was called on the scheduler-side KVPlugConnector")
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side connector method was called on the worker-side KVPlugConnector")
        return self._scheduler


def _route_logs_to_vllm() -> None:
    """Show kvplug's log lines (hits, load errors) where vLLM's own go, in its format."""
    kvplug_logger = logging.getLogger("kvplug")
    vllm_logger = logging.getLogger("vllm")
    if kvplug_logger.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        kvplug_logger.addHandler(handler)
    if kvplug_logger.level == logging.NOTSET:
        kvplug_logger.setLevel(vllm_logger.getEffectiveLevel())
    kvplug_logger.propagate = False
