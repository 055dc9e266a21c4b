"""A worker side over a real CacheEngine (cpu tier, sync store queue), driven one step at a
time with the metadata the scheduler side builds, as vLLM's model runner drives it (bind,
load, forward, save, results): for tests of what a worker loads and stores around failed
loads. No vLLM engine. Imported by name, as conftest is."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from kvplug import CacheEngine, Fingerprint, KVLayout, RequestInfo, load_config, slots_from_block_ids
from kvplug_vllm.layout import VLLM_CPU
from kvplug_vllm.metadata import KVPlugConnectorMetadata, RequestMeta
from kvplug_vllm.settings import ConnectorSettings
from kvplug_vllm.worker import WorkerSide

LAYOUT = KVLayout(VLLM_CPU, num_layers=2, block_size=32, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
PROMPT = list(range(3, 515))  # 8 chunks of 64
BLOCKS = list(range(8, 24))  # the request's 16 blocks


@contextmanager
def sync_engine(model_id: str) -> Iterator[CacheEngine]:
    """A cache engine of chunks of 64 tokens whose stores are written before they return."""
    config = load_config(engine_extra={"kvplug.chunk_size": 64, "kvplug.store.queue.mode": "sync"}, env={}).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id=model_id)) as cache:
        yield cache


def stored(engine: CacheEngine) -> list[bool]:
    """Which of the prompt's 8 chunks the tiers hold."""
    keys = engine.record_keys(engine.chunk_keys(PROMPT, RequestInfo()))
    return engine.chain.contains_any(keys)


class StepDriver:
    """A worker (synchronous loads) over ``engine`` whose caches hold the prompt's first
    ``stored_tokens`` tokens, stored: the lookups of the steps may promise more."""

    def __init__(self, engine: CacheEngine, name: str, stored_tokens: int = 128) -> None:
        source = [torch.randn(32, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
        engine.store(PROMPT[:stored_tokens], source, slots_from_block_ids(BLOCKS, 32, stored_tokens))
        self.meta = KVPlugConnectorMetadata()
        meta = self.meta
        parent = SimpleNamespace(has_connector_metadata=lambda: True, _get_connector_metadata=lambda: meta)
        vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_consumer=True, is_kv_producer=True))
        self.worker = WorkerSide(parent, vllm_config, ConnectorSettings(load="sync"), {}, (name, 0, 0))
        self.worker.engine, self.worker.kv_caches = engine, source

    def step(self, request: RequestMeta, finished: frozenset[str] = frozenset()) -> set[int]:
        """One step of ``request`` (``finished``: the ids vLLM names finished in it); the
        blocks reported not loaded."""
        self.meta.requests, self.meta.finished_req_ids = [request], sorted(finished)
        self.worker.begin_step()
        self.worker.start_load_kv()
        self.worker.wait_for_save()
        self.worker.get_finished(set(finished))
        return self.worker.get_block_ids_with_load_errors()

    def close(self) -> None:
        self.worker.engine = None  # the engine's owner closes it
        self.worker.background.close()
