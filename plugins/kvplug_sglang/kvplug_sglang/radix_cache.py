"""Radix-cache backend ``kvplug``: SGLang's ``RadixCache`` with kvplug under it.

Selected with ``--radix-cache-backend kvplug`` (the ``sglang.srt.plugins`` entry
point registers it in every SGLang process). It is SGLang's plain ``RadixCache``
— the class SGLang's own external-store backend (FlexKV, registered the same
way) extends — plus three things:

- **load**: when ``match_prefix`` for a request finds less on device than kvplug
  holds, it reports the difference as ``host_hit_length``; the scheduler then
  calls ``init_load_back``, which allocates slots from the
  ``token_to_kv_pool_allocator``, scatters the chunks into them with
  ``CacheEngine.retrieve`` and inserts them into the tree. All or nothing, as
  the scheduler requires: a chunk that turns out corrupt frees every slot and
  the request recomputes.
- **store**: a finished request's KV (``checkpoint`` of a finished request) is
  copied out of the pool right away and written to the tiers by kvplug's store
  worker; nothing stays locked.
- **evict**: a node evicted from device is stored first (its slots are freed
  but not yet reused when ``_delete_leaf`` runs), so kvplug keeps the data.

With tensor parallelism every rank runs this tree; hit lengths and load results
are agreed with an all_reduce MIN over the CPU (gloo) group of the ranks that run
the same batches (SGLang's ``tp_cache_group``: with attention DP, one DP rank's
attention-TP group) so their trees stay identical. A rank's pool holds the KV heads
of its attention-TP rank, which its keys name.

Attention context parallelism (``--attn-cp-size``) is served: SGLang's dense-MHA CP gathers every
peer's K and V before it writes the pool (``materialize_full_kv``), so CP peers hold the same KV of
the same heads, and they run the same batches (their hits are agreed in ``tp_cache_group``). Decode
context parallelism (``--dcp-size`` > 1) is refused: each DCP rank keeps only every ``dcp_size``-th
token (the tree's page size is widened by ``dcp_size``, its indices are not the pool's slots), so
a chunk gathered at the tree's indices is not the KV the engine computed.

Pipeline parallelism (``--pp-size`` > 1) is refused: each stage would have to agree on every
hit with the others inside ``match_prefix``, on its scheduler thread, and a later stage can be
waiting there for outputs the first stage sends only after scheduling its next batch (caught in
a stack: stage 0 in this all_reduce, stage 1 in ``_pp_recv_dict_from_prev_stage``), so the server
stops answering. Pipeline stages are served by the HiCache storage backend
(``kvplug_sglang.hicache.KVPlugStorage``), whose hits SGLang's cache controller agrees off the
scheduler thread.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from sglang.srt.mem_cache.base_prefix_cache import (
    CacheRequestHandle,
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

import kvplug
from kvplug_sglang.at_exit import close_at_exit
from kvplug_sglang.control import rank_in_replica, start_control
from kvplug_sglang.page_identity import weights_generation
from kvplug_sglang.request_keys import RequestKeys, lora_refs_of
from kvplug_sglang.setup_engine import build_cache_engine, model_id_of

logger = logging.getLogger("kvplug.sglang.radix")

BACKEND_NAME = "kvplug"


@dataclass(frozen=True)
class _LoadPlan:
    """A hit found by ``match_prefix`` and waiting for ``init_load_back``."""

    key: RadixKey  # page-aligned, detached from the request's growing token list
    device_len: int
    hit_len: int


class KVPlugRadixCache(RadixCache):
    """``RadixCache`` that loads prefix misses from kvplug and stores into it."""

    def __init__(
        self,
        params: CacheInitParams,
        *,
        model_config: Any,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: dist.ProcessGroup | None = None,
        config: kvplug.KVPlugConfig | None = None,
        tp_worker: Any = None,
        attn_tp: tuple[int, int] | None = None,
    ) -> None:
        """``tp_rank``/``tp_size``: the rank's place in the TP group (its control socket);
        ``attn_tp``: its attention-TP rank and size, whose KV heads the pool holds (default
        ``tp_rank``, ``tp_size``); ``tp_group``: the ranks that run the same batches."""
        heads_rank, heads_size = attn_tp if attn_tp is not None else (tp_rank, tp_size)
        self._plans: dict[CacheRequestHandle, _LoadPlan] = {}
        #: kvplug's request identity of a radix key (a LoRA adapter by where it was loaded from).
        self.request_keys = RequestKeys(lora_refs_of(tp_worker))
        super().__init__(params)
        kvcache = self.token_to_kv_pool_allocator.get_kvcache()
        self.kv_caches = list(zip(kvcache.k_buffer, kvcache.v_buffer))
        self.engine = build_cache_engine(
            model_config=model_config,
            k_pool=kvcache.k_buffer,
            v_pool=kvcache.v_buffer,
            tp_rank=heads_rank,
            tp_size=heads_size,
            page_size=self.page_size,
            config=config,
            first_layer=int(getattr(kvcache, "start_layer", 0) or 0),  # a pipeline stage's layers
        )
        #: The ranks that agree on every hit and load (None: this rank alone).
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        control_rank, control_size = rank_in_replica(tp_rank, tp_size)
        self.control = start_control(
            self.engine, name=model_id_of(model_config), tp_rank=control_rank, tp_size=control_size
        )
        self.loaded_tokens = 0
        self.load_failures = 0
        #: The weights generation the tree's KV was computed with (SGLang flushes it after an update).
        self.weights = weights_generation()
        close_at_exit(self)  # kvplug's store worker is a daemon thread: queued stores would be lost

    # --- load -----------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        base = super().match_prefix(params)
        req = params.req
        if self.disable or req is None or self.is_eagle:
            return base
        key = params.key.page_aligned(self.page_size)
        device_len = base.device_prefix_len
        hit = 0
        if len(key) > device_len:
            try:
                hit = self.engine.lookup(key.raw_token_ids(), request=self.request_keys.for_request(key, req.lora_id))
            except Exception:
                logger.exception("kvplug lookup failed; treating as a miss")
            hit = min(hit, len(key)) // self.page_size * self.page_size
        hit = self._agree(hit)
        handle = req.cache_request_handle
        if hit <= device_len:
            self._plans.pop(handle, None)
            return base
        snapshot = RadixKey(array("q", key.raw_token_ids()[:hit]), key.extra_key, cache_salt=key.cache_salt)
        self._plans[handle] = _LoadPlan(snapshot, device_len, hit)
        return base._replace(host_hit_length=hit - device_len)

    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, TreeNode]:
        """Load the hit ``match_prefix`` promised into new slots; all of it or nothing."""
        last_node = params.best_match_node
        plan = self._plans.pop(params.req.cache_request_handle, None) if params.req is not None else None
        if plan is None or params.host_hit_length <= 0:
            return 0, last_node
        prefix = self.path_device_indices(last_node)
        need = plan.hit_len - plan.device_len
        ok = len(prefix) == plan.device_len and params.host_hit_length == need
        slots = None
        if ok:
            # The prefix this load extends is not locked yet (the scheduler locks the node this
            # returns): evicting for room could free its slots and hand them out again below.
            self.inc_lock_ref(last_node)
            try:
                if self.token_to_kv_pool_allocator.available_size() < need:
                    self.evict(EvictParams(num_tokens=need))
                slots = self.token_to_kv_pool_allocator.alloc(need)
            finally:
                self.dec_lock_ref(last_node)
            lora_id = getattr(params.req, "lora_id", None)
            ok = slots is not None and self._retrieve(plan, prefix, slots, lora_id) == need
        if self._agree(int(ok)) == 0:
            if slots is not None:
                self.token_to_kv_pool_allocator.free(slots)
            self.load_failures += 1
            return 0, last_node
        assert slots is not None  # every rank agreed its load succeeded
        values = torch.cat([prefix.to(torch.int64), slots.to(torch.int64)])
        result = self.insert(InsertParams(key=plan.key, value=values, priority=last_node.priority))
        if result.prefix_len > plan.device_len:
            # The tree grew under us (another insert of the same prefix): those
            # tokens are served by the tree's slots, ours are duplicates.
            self.token_to_kv_pool_allocator.free(slots[: result.prefix_len - plan.device_len])
        self.loaded_tokens += need
        return need, result.last_device_node

    def _retrieve(self, plan: _LoadPlan, prefix: torch.Tensor, slots: torch.Tensor, lora_id: str | None) -> int:
        mask = torch.ones(plan.hit_len, dtype=torch.bool)
        mask[: plan.device_len] = False
        all_slots = torch.cat([prefix.to(torch.int64).cpu(), slots.to(torch.int64).cpu()])
        try:
            loaded = self.engine.retrieve(
                plan.key.raw_token_ids(),
                self.kv_caches,
                all_slots,
                mask,
                request=self.request_keys.for_request(plan.key, lora_id),
            )
        except Exception:
            logger.exception("kvplug retrieve failed; recomputing")
            return 0
        return int(loaded.sum())

    def load_back_is_cache_owned(self) -> bool:
        return True

    # --- store ----------------------------------------------------------------------

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        super().checkpoint(req, up_to=up_to)
        if not self.disable and req.finished() and req.last_node is not None:
            self._store_path(req.last_node, req)

    def _delete_leaf(self, node: TreeNode) -> None:
        # Called by RadixCache.evict right after it returned node.value to the
        # allocator: the slots are free but nothing has been written to them yet
        # (allocation happens after eviction), so their KV is still intact.
        self._store_path(node)
        super()._delete_leaf(node)

    def _store_path(self, node: TreeNode, req: Any = None) -> None:
        """Store the KV of the whole path root -> ``node`` (kvplug skips chunks it has)."""
        if getattr(node, "_kvplug_stored", False) or self.is_eagle or node is self.root_node:
            return
        if self.weights != weights_generation():
            # The weights were updated in place and SGLang has not flushed the tree since (a
            # flush refused while requests ran): its KV is the old weights', which must not be
            # stored under the new weights' keys. Stores resume with the flush (reset).
            return
        keys: list[RadixKey] = []
        walk = node
        while walk is not self.root_node and walk is not None:
            keys.append(walk.key)
            walk = walk.parent
        tokens = array("q")
        for key in reversed(keys):
            tokens.extend(key.raw_token_ids())
        slots = self.path_device_indices(node).to(torch.int64)
        try:
            self.engine.store(tokens, self.kv_caches, slots, request=self._request_of(node.key, req))
        except Exception:
            logger.exception("kvplug store failed; the KV stays on device only")
            return
        node._kvplug_stored = True

    def _request_of(self, key: RadixKey, req: Any) -> kvplug.RequestInfo | None:
        """``key``'s identity: by its request, or (``req`` None: an evicted node) as one resolved it."""
        if req is None:
            return self.request_keys.for_node(key)
        return self.request_keys.for_request(key, req.lora_id)

    # --- lifecycle ------------------------------------------------------------------

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        self._plans.pop(req.cache_request_handle, None)

    def release_aborted_request(self, handle: CacheRequestHandle) -> None:
        self._plans.pop(handle, None)

    def flush_pending_backups(self) -> None:
        """Nothing to submit: a store is queued to kvplug's worker as it is made. (SGLang calls
        this after every batch; waiting here for the tiers stalled serving on a slow one.)"""

    def reset(self) -> None:
        super().reset()
        self._plans.clear()
        self.weights = weights_generation()

    def close(self) -> None:
        """What :meth:`shutdown` does (the name :func:`close_at_exit` calls)."""
        self.shutdown()

    def shutdown(self) -> None:
        """Write what is queued to the tiers and close them."""
        control = getattr(self, "control", None)
        if control is not None:
            control.close()
            self.control = None
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def _agree(self, local: int) -> int:
        """The minimum of ``local`` over the ranks running this batch."""
        if self.tp_group is None:
            return local
        tensor = torch.tensor([local], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.tp_group)
        return int(tensor.item())


#: Where the radix-cache backend cannot serve, what to start instead (kvplug-sglang's README, way 2).
_USE_HICACHE = (
    "use the HiCache storage backend kvplug_sglang.hicache.KVPlugStorage instead of --radix-cache-backend: "
    "--enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config "
    '\'{"backend_name": "kvplug", "module_path": "kvplug_sglang.hicache", "class_name": "KVPlugStorage", '
    "\"interface_v1\": 1}' (kvplug's config still from KVPLUG_CONFIG; kvplug-sglang's README, way 2)"
)


def kvplug_radix_cache_factory(ctx: Any) -> KVPlugRadixCache:
    """``RadixCacheFactory`` for SGLang's registry (``TreeCacheBuildContext`` in, cache out)."""
    unsupported = [
        name
        for name, on in (
            ("hybrid SWA models", ctx.is_hybrid_swa),
            ("hybrid SSM (mamba) models", ctx.is_hybrid_ssm),
            ("DSA models", getattr(ctx, "is_dsa", False)),
            (
                f"pipeline parallelism (--pp-size > 1; {_USE_HICACHE})",
                int(getattr(ctx.server_args, "pp_size", 1) or 1) > 1,
            ),
            (f"--enable-hierarchical-cache ({_USE_HICACHE})", ctx.enable_hierarchical_cache),
            (
                "decode context parallelism (--dcp-size > 1: a rank's pool holds only its share of each "
                "page's tokens, at slots that are not the tree's, so a chunk stored from it is not the KV)",
                int(getattr(ctx.server_args, "dcp_size", 1) or 1) > 1,
            ),
        )
        if on
    ]
    if unsupported:
        raise ValueError(f"--radix-cache-backend {BACKEND_NAME} does not support {', '.join(unsupported)}")
    # The ranks that run one batch: with attention DP each DP rank runs its own, and a
    # collective over the whole TP group would pair one rank's calls with another's.
    tp_group = ctx.params.tp_cache_group or getattr(ctx.tp_group, "cpu_group", ctx.tp_group)
    return KVPlugRadixCache(
        ctx.params,
        model_config=ctx.model_config,
        tp_rank=ctx.tp_rank,
        tp_size=ctx.tp_size,
        tp_group=tp_group,
        tp_worker=ctx.tp_worker,
        attn_tp=_attention_tp(ctx),
    )


def _attention_tp(ctx: Any) -> tuple[int, int]:
    """This rank's attention-TP rank and size: with attention DP or CP its pool holds the
    heads of that rank (CP peers hold the same KV: SGLang all-gathers it before writing)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        parallel = get_parallel()
        return int(parallel.attn_tp_rank), int(parallel.attn_tp_size)
    except (RuntimeError, ValueError):  # no parallel config published in this process
        return int(ctx.tp_rank), int(ctx.tp_size)
