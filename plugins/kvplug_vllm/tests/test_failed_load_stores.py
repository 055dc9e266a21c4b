"""A request whose synchronous load failed stores nothing until vLLM has rolled it back.

vLLM's async scheduling (its default on GPUs) and pipeline parallelism schedule step N+1
before they have step N's output: a long prompt's next prefill chunk runs on top of blocks
whose load failed in step N, before vLLM rolls the request back to the first of them. Its KV
must not be stored: the chunks would keep the prompt's keys, and a later request would load
KV computed from blocks that never held this prompt's KV.

No vLLM engine: the worker side over a real CacheEngine (cpu tier) and real caches, fed the
metadata the scheduler side builds for those steps (``RequestMeta.epoch`` counts rollbacks),
and the scheduler side counting a rollback.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from kvplug import CacheEngine, Fingerprint, KVLayout, RequestInfo, load_config, slots_from_block_ids
from kvplug_vllm.layout import VLLM_CPU
from kvplug_vllm.metadata import KVPlugConnectorMetadata, LoadSpec, RequestMeta
from kvplug_vllm.settings import ConnectorSettings
from kvplug_vllm.worker import WorkerSide

LAYOUT = KVLayout(VLLM_CPU, num_layers=2, block_size=32, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
PROMPT = list(range(3, 515))  # 8 chunks of 64
BLOCKS = list(range(8, 24))  # the request's 16 blocks


@pytest.fixture
def engine() -> Iterator[CacheEngine]:
    config = load_config(engine_extra={"kvplug.chunk_size": 64, "kvplug.store.queue.mode": "sync"}, env={}).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="failed-load-stores")) as cache:
        yield cache


def stored(engine: CacheEngine) -> list[bool]:
    """Which of the prompt's 8 chunks the tiers hold."""
    keys = engine.record_keys(engine.chunk_keys(PROMPT, RequestInfo()))
    return engine.chain.contains_any(keys)


def test_steps_scheduled_before_vllm_saw_the_failed_load_store_nothing(engine: CacheEngine) -> None:
    source = [torch.randn(32, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
    engine.store(PROMPT[:128], source, slots_from_block_ids(BLOCKS, 32, 128))  # 2 chunks; the lookup saw 4
    meta = KVPlugConnectorMetadata()
    parent = SimpleNamespace(has_connector_metadata=lambda: True, _get_connector_metadata=lambda: meta)
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_consumer=True, is_kv_producer=True))
    worker = WorkerSide(parent, vllm_config, ConnectorSettings(load="sync"), {}, ("failed-load", 0, 0))
    worker.engine, worker.kv_caches = engine, source

    def step(request: RequestMeta, finished: frozenset[str] = frozenset()) -> set[int]:
        meta.requests, meta.finished_req_ids = [request], sorted(finished)
        worker.begin_step()
        worker.start_load_kv()
        worker.wait_for_save()
        worker.get_finished(set(finished))
        return worker.get_block_ids_with_load_errors()

    try:
        # step N: load 256 tokens (only 128 still there), compute [256, 320)
        load = LoadSpec(num_computed=0, num_hit=256, num_external=256)
        assert step(RequestMeta("r", PROMPT, BLOCKS, load=load, save_start=256, save_end=320)) == {12, 13, 14, 15}
        # step N+1, scheduled before vLLM had step N's output: the next chunk, on top of blocks 12-15
        assert step(RequestMeta("r", PROMPT, BLOCKS, save_start=320, save_end=384)) == set()
        assert stored(engine) == [True, True] + [False] * 6
        # vLLM rolled it back to token 128: what it recomputes from there is stored
        assert step(RequestMeta("r", PROMPT, BLOCKS, save_start=128, save_end=192, epoch=1)) == set()
        assert stored(engine) == [True, True, True] + [False] * 5
        assert worker.results._poisoned == {}
        # a request that finishes before vLLM rolled it back leaves nothing behind
        assert step(RequestMeta("s", PROMPT, BLOCKS, load=load)) == {14, 15}  # chunk 2 is back
        assert "s" in worker.results._poisoned
        step(RequestMeta("r", PROMPT, BLOCKS, epoch=1), finished=frozenset({"s"}))  # the next step names it finished
        assert worker.results._poisoned == {}
    finally:
        worker.engine = None  # the fixture closes the engine
        worker.background.close()
