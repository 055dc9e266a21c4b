"""A worker's load hashes the promised prompt at most once: the chunk keys it indexes for KV
events are the keys its fetch reads (the engine's ``retrieve_layerwise(keys=...)``), and
none at all when its lookup's chunk hashes came with the load (``LoadSpec.chunk_hashes``).

No vLLM engine: the worker side over a real CacheEngine (cpu tier) and real caches, its
metadata plain data as the scheduler side builds it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvplug import CacheEngine, ChunkKey, Fingerprint, KVLayout, load_config, slots_from_block_ids
from kvplug.core.engine.locations import chunk_hash
from kvplug.core.keys import KeyBuilder
from kvplug_vllm.kv_events import ChunkIndex
from kvplug_vllm.layout import VLLM_CPU
from kvplug_vllm.metadata import KVPlugConnectorMetadata, LoadSpec, RequestMeta
from kvplug_vllm.settings import ConnectorSettings
from kvplug_vllm.worker import WorkerSide

LAYOUT = KVLayout(VLLM_CPU, num_layers=2, block_size=32, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
PROMPT = list(range(3, 203))  # 3 whole chunks of 64 and 8 tokens


@dataclass(frozen=True)
class CountingKeyBuilder(KeyBuilder):
    """The engine's key builder, counting the prompts it hashes."""

    calls: list[int] = None  # type: ignore[assignment]

    def keys(self, tokens: Sequence[int] | torch.Tensor, *args: Any, **kwargs: Any) -> list[ChunkKey]:
        self.calls.append(len(tokens))
        return super().keys(tokens, *args, **kwargs)


@pytest.fixture
def engine() -> Iterator[CacheEngine]:
    config = load_config(engine_extra={"kvplug.chunk_size": 64, "kvplug.store.queue.mode": "sync"}, env={}).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="hash")) as cache:
        yield cache


def load(engine: CacheEngine, spec: LoadSpec, events: bool = True) -> tuple[list[int], list[torch.Tensor], WorkerSide]:
    """Store the prompt, then run one worker step that loads ``spec`` (``events``: with vLLM's KV
    events on, the worker indexes chunks for them): the prompts hashed, the caches."""
    source = [torch.randn(16, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
    engine.store(PROMPT, source, slots_from_block_ids(list(range(1, 8)), 32, len(PROMPT)))
    meta = KVPlugConnectorMetadata(requests=[RequestMeta("r1", PROMPT[:192], list(range(8, 15)), load=spec)])
    parent = SimpleNamespace(has_connector_metadata=lambda: True, _get_connector_metadata=lambda: meta)
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_consumer=True, is_kv_producer=False))
    worker = WorkerSide(parent, vllm_config, ConnectorSettings(load="sync"), {}, ("hash", 0, 0))
    worker.engine, worker.kv_caches = engine, [torch.zeros_like(layer) for layer in source]
    worker.index = ChunkIndex(LAYOUT.block_size, ["cpu"]) if events else None
    calls: list[int] = []
    engine.key_builder = CountingKeyBuilder(engine.chunk_size, engine.config.hash, calls=calls)
    try:
        worker.begin_step()
        worker.start_load_kv()
        assert worker.get_block_ids_with_load_errors() == set()
        for layer, loaded in zip(source, worker.kv_caches):
            assert torch.equal(layer[1:7], loaded[8:14])  # blocks 1-6 (192 tokens) landed in 8-13
    finally:
        worker.engine = None  # the fixture closes the engine
        worker.background.close()
    return calls, worker.kv_caches, worker


@pytest.mark.parametrize("events", [True, False], ids=["kv-events", "no-events"])
def test_a_load_hashes_the_prompt_once(engine: CacheEngine, events: bool) -> None:
    calls, _, _ = load(engine, LoadSpec(num_computed=0, num_hit=192, num_external=192), events)
    assert calls == [192]  # indexed for KV events (where published) and fetched under the same keys


@pytest.mark.parametrize("events", [True, False], ids=["kv-events", "no-events"])
def test_a_load_with_its_lookups_chunk_hashes_hashes_nothing(engine: CacheEngine, events: bool) -> None:
    hashes = [chunk_hash(key.key) for key in engine.chunk_keys(PROMPT[:192])]  # what its lookup answered
    spec = LoadSpec(num_computed=0, num_hit=192, num_external=192, chunk_hashes=hashes)
    calls, _, _ = load(engine, spec, events)
    assert calls == []  # the lookup's hashes named the chunks: the blocks above are the stored KV
