"""Soak helpers: one request through a real SGLang tree cache, stopped where the scheduler can
abort it, and what a process holds (threads, file descriptors) between rounds.

``drive`` follows the scheduler's calls as ``sglang_flow.serve_request`` does, with the aborts
SGLang makes: a request aborted in the waiting queue after its prefix was matched
(``Scheduler.abort_request``: ``tree_cache.finish(handle, ABORT)``), one whose load-back ran
but that was not admitted (``PrefillAdder`` rejects it after ``init_load_back``) and then
aborted in the queue, and one aborted while running (a client that disconnects mid-stream: it
ends as ``FINISH_ABORT`` with part of its prompt computed, and its KV row is released with a
checkpoint of what was computed). A request can also be preempted after its prefill
(``RETRACTED``) and run again.
"""

from __future__ import annotations

import os
import threading
from array import array
from typing import Any

import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome, EvictParams, InitLoadBackParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang_flow import Stack
from sglang_pools import fill_random

#: Thread pools that start their threads as work comes, up to a bound: name -> bound.
POOLS = {"kvplug-disk-io": 2}

#: Where ``drive`` stops a request: ``None`` runs it to its end.
ABORTS = ("queued", "loaded", "running")
#: ``drive(..., abort=RETRACTED)``: the request is preempted after its prefill (SGLang's
#: ``retract_decode``); the caller drives it again, as the scheduler does from its queue.
RETRACTED = "retracted"


def drive(stack: Stack, rid: str, tokens: list[int], seed: int, abort: str | None = None) -> tuple[int, int]:
    """One request; returns (kvplug's promised hit, what ``init_load_back`` loaded)."""
    tree, allocator = stack.tree, stack.allocator
    req = Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=1))
    req.output_ids = array("q")
    req.init_next_round_input(tree)
    promised, loaded = req.host_hit_length, 0
    if abort == "queued":
        tree.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
        return promised, loaded
    if promised:
        loaded, node = tree.init_load_back(
            InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=promised, req=req)
        )
        req.prefix_len += loaded
        req.last_node = node
        req.kv.cache_protected_len = req.prefix_len
    if abort == "loaded":
        tree.finish(req.cache_request_handle, CacheRequestOutcome.ABORT)
        return promised, loaded
    req.lock = tree.lock(req.last_node)
    stack.req_pool.alloc([req])
    prefix = tree.prefix_device_indices(req)
    # aborted mid-run: the first chunk of a chunked prefill ran (what it allocated, it computed)
    computed = len(tokens) if abort in (None, RETRACTED) else req.prefix_len + (len(tokens) - req.prefix_len) // 2
    need = computed - req.prefix_len
    whole = -(-need // allocator.page_size) * allocator.page_size  # the paged allocator hands out pages
    if allocator.available_size() < whole:  # SGLang's alloc_token_slots evicts for room first
        tree.evict(EvictParams(num_tokens=whole))
    new = allocator.alloc(whole)[:need] if need else torch.empty(0, dtype=torch.int64)
    row = torch.cat([prefix.to(torch.int64), new.to(torch.int64)])
    stack.req_pool.write((req.kv.req_pool_idx, slice(0, len(row))), row.to(torch.int32))
    fill_random(stack.pool, new, seed)  # the prefill
    req.kv.kv_allocated_len = req.kv.kv_committed_len = computed
    if abort == "retracted":  # preempted: its KV is freed, not kept; it goes back to the queue
        release_kv_cache(req, tree, checkpoint=False)
        return promised, loaded
    req.finished_reason = FINISH_ABORT() if abort == "running" else FINISH_LENGTH(length=0)
    req.finished_len = computed
    release_kv_cache(req, tree, checkpoint=True)
    return promised, loaded


def flush_cache(stack: Stack) -> None:
    """What ``Scheduler.flush_cache`` (``/flush_cache``) does to the caches, no request in flight."""
    stack.tree.reset()
    stack.req_pool.clear()
    stack.allocator.clear()


def process_level() -> dict[str, Any]:
    """This process's Python threads by name (numbers left out), all its threads, and its fds."""
    names = sorted(thread.name.rstrip("0123456789_-") for thread in threading.enumerate())
    return {
        "python_threads": {name: names.count(name) for name in names},
        "tasks": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
    }
