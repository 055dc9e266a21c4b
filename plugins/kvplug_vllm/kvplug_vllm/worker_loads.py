"""Writing fetched KV into the paged cache, and judging what did not load (the worker's loads).

A synchronous load fetches its chunks before the forward pass and writes them at once, or
layer by layer inside it (:class:`~kvplug_vllm.layerwise_step.LayerwiseStep`). A background
load is written between two forward passes, once its fetch is done. Either way, the promised
blocks that did not load go to :class:`~kvplug_vllm.load_results.LoadResults`, which reports
them to vLLM; a failed synchronous load also stops the request's stores until vLLM rolled it back.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvplug import CacheEngine, ChunkKey
from kvplug_vllm.background import GroupsRetrieve, fetch
from kvplug_vllm.layerwise_step import LayerwiseStep
from kvplug_vllm.load_results import LoadResults
from kvplug_vllm.metadata import RequestMeta
from kvplug_vllm.stats import LOAD_ERROR_PREFIX, KVPlugConnectorStats
from kvplug_vllm.worker_stats import count_load_phases

logger = logging.getLogger("kvplug.vllm")


def load_now(
    engine: CacheEngine,
    request: RequestMeta,
    kv_caches: list[torch.Tensor],
    keys: list[ChunkKey] | None,
    layers: LayerwiseStep | None,
    results: LoadResults,
    stats: KVPlugConnectorStats,
) -> None:
    """Fetch ``request``'s promised chunks and write them (``layers``: one layer per call,
    inside the forward pass); note the blocks that did not load."""
    assert request.load is not None
    started = time.perf_counter()
    try:
        retriever = fetch(engine, request, kv_caches, keys)
        if layers is not None:
            layers.add_load(request, retriever)
        else:
            retriever.write_remaining()
            count_load_phases(stats, retriever)
        loaded = retriever.loaded_mask
    except Exception:
        logger.exception("request %s: loading failed; its blocks will be recomputed", request.req_id)
        loaded = torch.zeros(len(request.token_ids[: request.load.num_hit]), dtype=torch.bool)
    stats.sample("load_seconds", time.perf_counter() - started)
    results.check_blocks(request, loaded, engine.layout.block_size, stats)
    if request.req_id in results.failed_this_step:
        results.poison(request)


def write_background_loads(
    done: list[tuple[RequestMeta, Any, float]],
    engine: CacheEngine,
    results: LoadResults,
    stats: KVPlugConnectorStats,
    *,
    timeout_s: float,
    groups: bool,
) -> bool:
    """Write the finished background fetches ``done`` into the paged cache; note those that
    failed or ran past ``timeout_s``. ``groups``: the model has several KV cache groups, whose
    loads count whole or not at all. Returns whether any KV was written."""
    worked = False
    for request, retriever, seconds in done:
        stats.sample("load_seconds", seconds)
        if retriever is None:
            reason = "deadline" if seconds >= timeout_s else "fetch_failed"
            stats.add(**{LOAD_ERROR_PREFIX + reason: 1})
        if retriever is not None:
            worked = True
            try:
                retriever.write_remaining()
                count_load_phases(stats, retriever)
            except Exception:
                logger.exception(
                    "request %s: writing the loaded KV failed; its blocks will be recomputed", request.req_id
                )
                retriever = None  # whatever its masks say: a write that raised may have stopped anywhere
        if isinstance(retriever, GroupsRetrieve) or (retriever is None and groups):
            results.check_groups(request, retriever, stats)
        else:
            loaded = retriever.loaded_mask if retriever is not None else None
            results.check_blocks(request, loaded, engine.layout.block_size, stats)
    return worked
