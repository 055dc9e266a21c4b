"""vLLM's own scheduler with KVPlugConnector on its scheduler side, and no model runner.

``Scheduler`` is vLLM's class, built from a real ``VllmConfig`` of the tiny random model
(only its config is read: no weights, no worker process); vLLM makes the connector itself
from ``kv_transfer_config``, by its registered name. Its lookups go to a real
:class:`kvplug.CacheEngine` registered as this process's worker (``lookup_channel:
direct``), so a test drives ``add_request``/``schedule``/``finish_requests`` and reads the
metadata vLLM hands to the workers, as vLLM builds it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvplug import CacheEngine, Fingerprint, KVLayout, load_config
from kvplug_vllm.layout import VLLM_CPU
from kvplug_vllm.lookup import LocalWorker, register_local, unregister_local

BLOCK_SIZE = 32
CHUNK_SIZE = 64
NUM_BLOCKS = 64
LAYOUT = KVLayout(VLLM_CPU, num_layers=2, block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


@contextmanager
def real_scheduler(
    model: str, engine_id: str, *, max_num_batched_tokens: int = 1024
) -> Iterator[tuple[Any, CacheEngine]]:
    """vLLM's ``Scheduler`` with KVPlugConnector, and the cache engine its lookups ask (cpu tier)."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvplug_vllm.registration import register

    register()
    extra = {"kvplug.chunk_size": CHUNK_SIZE, "kvplug.lookup_channel": "direct"}
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model, dtype="bfloat16", seed=0, max_model_len=1024, skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVPlugConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            engine_id=engine_id,
            kv_connector_extra_config=extra,
        ),
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )
    init_none_hash(sha256)
    engine_extra = {"kvplug.chunk_size": CHUNK_SIZE, "kvplug.store.queue.mode": "sync"}
    config = load_config(engine_extra=engine_extra, env={}).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="real-scheduler")) as engine:
        register_local((engine_id, 0, 0), LocalWorker(engine, lambda: 0))
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK_SIZE,
        )
        try:
            yield scheduler, engine
        finally:
            scheduler.shutdown()
            unregister_local((engine_id, 0, 0))


def new_request(request_id: str, prompt: list[int], max_tokens: int = 4) -> Any:
    """A vLLM ``Request`` as its engine core makes one (block hashes for its prefix cache)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), None, block_hasher=hasher)
