"""Drive a real SGLang tree cache the way the scheduler does, on CPU, without a model.

``serve_request`` follows the scheduler's calls for one request: match
(``Req.init_next_round_input``), ``init_load_back`` for a host/kvplug hit,
lock, row allocation, "prefill" (random KV written with ``set_kv_buffer``),
finish, ``release_kv_cache`` (checkpoint + free). The tree is built by SGLang's
own ``create_tree_cache`` from a published ServerArgs, like a scheduler's.
"""

from __future__ import annotations

import contextlib
import warnings
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

warnings.filterwarnings("ignore", message=".*support (AWQ|GGUF).*")

import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang_pools import NUM_HEADS, fill_random, make_pool, snapshot  # noqa: E402


@contextlib.contextmanager
def published_server_args(*, world_rank: int = 0, dp_rank: int | None = None, **fields: Any) -> Iterator[Any]:
    """Publish ServerArgs in SGLang's runtime context (what a scheduler process does; its
    ``world_rank`` and ``dp_rank`` as the launcher gives them)."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", device="cpu", **fields)
    reset_context()
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=world_rank, dp_rank=dp_rank))
    try:
        yield server_args
    finally:
        reset_context()


@dataclass
class Stack:
    pool: Any
    allocator: Any
    req_pool: Any
    tree: Any


def build_stack(
    server_args: Any,
    model_config: Any,
    *,
    page_size: int = 1,
    size: int = 256,
    tp_worker: Any = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    heads: int = NUM_HEADS,
    **pool_kinds: bool,
) -> Stack:
    """A radix cache as SGLang's scheduler builds it; ``pool_kinds`` sets the context's model
    flags (``is_hybrid_swa``, ``is_hybrid_ssm``, ``is_dsa``); ``tp_worker``: the scheduler's
    (the tree reads its LoRA manager's adapters); ``tp_size``: the TP width the scheduler passes
    (``tp_rank`` of it), whatever the pool's attention-TP width; ``heads``: the pool's KV heads."""
    pool = make_pool(size=size, page_size=page_size, heads=heads)
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", pool, False)
    else:
        allocator = PagedTokenToKVPoolAllocator(size, page_size, torch.bfloat16, "cpu", pool, False)
    req_pool = ReqToTokenPool(8, 1024, "cpu", False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator, page_size=page_size
    )
    ctx = TreeCacheBuildContext(
        server_args=server_args,
        params=params,
        **{"is_hybrid_swa": False, "is_hybrid_ssm": False, **pool_kinds},
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=tp_worker,
        model_config=model_config,
        tp_size=tp_size,
        tp_rank=tp_rank,
        tp_group=None,
    )
    return Stack(pool, allocator, req_pool, create_tree_cache(ctx))


@dataclass
class Served:
    device_hit: int
    promised: int  # host_hit_length reported by match_prefix
    loaded: int  # what init_load_back put on device
    slots: torch.Tensor  # the request's row (prefix + new slots)
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # KV at those slots when the request finished


def serve_request(
    stack: Stack, rid: str, tokens: list[int], seed: int, *, before_load: Any = None, **req_fields: Any
) -> Served:
    """``req_fields``: more of the ``Req`` (``lora_id``, ``extra_key``, ``cache_salt``)."""
    tree, allocator = stack.tree, stack.allocator
    req = Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=1), **req_fields)
    req.output_ids = array("q")
    req.init_next_round_input(tree)
    device_hit, promised, loaded = req.prefix_len, req.host_hit_length, 0
    if promised:
        if before_load is not None:
            before_load()
        loaded, node = tree.init_load_back(
            InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=promised, req=req)
        )
        req.prefix_len += loaded
        req.last_node = node
        if tree.load_back_is_cache_owned():
            req.kv.cache_protected_len = req.prefix_len
    req.lock = tree.lock(req.last_node)
    stack.req_pool.alloc([req])
    prefix = tree.prefix_device_indices(req)
    need = len(tokens) - req.prefix_len
    page = allocator.page_size
    # the paged allocator hands out whole pages; the row holds the tokens' slots
    allocated = allocator.alloc(-(-need // page) * page) if need else torch.empty(0, dtype=torch.int64)
    new = allocated[:need]
    fill_random(stack.pool, new, seed)  # the "prefill" of the tokens not cached
    row = torch.cat([prefix.to(torch.int64), new.to(torch.int64)])
    stack.req_pool.write((req.kv.req_pool_idx, slice(0, len(row))), row.to(torch.int32))
    req.kv.kv_allocated_len = len(tokens)
    req.kv.kv_committed_len = len(tokens)
    kv = snapshot(stack.pool, row)
    req.finished_reason = FINISH_LENGTH(length=0)
    req.finished_len = len(tokens)
    release_kv_cache(req, tree, checkpoint=True)
    return Served(device_hit, promised, loaded, row, kv)
