"""Loads whose write into the paged cache fails: a layer-wise load that fails in the middle of
the forward pass (its blocks are reported for recompute, and nothing the step computed on top
of them is stored), and a hybrid model's background load whose write raises (failed by request).

No vLLM engine: the worker side over a real CacheEngine (cpu tier) and real caches, driven as
vLLM's model runner drives it (bind, start_load_kv, per layer wait_for_layer_load then
save_kv_layer, wait_for_save, get_block_ids_with_load_errors). The fault is a connector of
this file that refuses the copy into one layer, as a device error would, or raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from kvplug import CacheEngine, Fingerprint, KVConnector, KVLayout, RequestInfo, load_config, slots_from_block_ids
from kvplug.errors import ConnectorError
from kvplug_vllm.background import fetch_groups
from kvplug_vllm.layout import VLLM_CPU
from kvplug_vllm.metadata import KVPlugConnectorMetadata, LoadSpec, RequestMeta
from kvplug_vllm.settings import ConnectorSettings
from kvplug_vllm.worker import WorkerSide

LAYOUT = KVLayout(VLLM_CPU, num_layers=2, block_size=32, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
PROMPT = list(range(3, 259))  # 4 whole chunks of 64
LAYERS = ["layer.0", "layer.1"]


class RefusesLayer(KVConnector):
    """The engine's connector, except that every write into layer ``layer`` fails."""

    name: ClassVar[str] = "refuses-layer"

    def __init__(self, real: KVConnector, layer: int) -> None:
        super().__init__(real.config, real.layout)
        self.real, self.layer = real, layer

    def wants_pinned_frames(self) -> bool:
        return self.real.wants_pinned_frames()

    def plan(self, slots: torch.Tensor) -> Any:
        return self.real.plan(slots)

    def plan_many(self, slots: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[Any]:
        return self.real.plan_many(slots, spans)

    def gather_layer(self, layer_cache: Any, plan: Any, out: torch.Tensor) -> None:
        self.real.gather_layer(layer_cache, plan, out)

    def scatter_layer(self, layer_cache: Any, plan: Any, src: torch.Tensor) -> None:
        self.real.scatter_layer(layer_cache, plan, src)

    def gather_copies(self, *args: Any, **kwargs: Any) -> list[Callable[[], None]]:
        return self.real.gather_copies(*args, **kwargs)

    def scatter_copies(self, kv_caches: Any, layers: range, *args: Any, **kwargs: Any) -> list[Callable[[], None]]:
        if self.layer in layers:
            raise ConnectorError(f"copy into layer {self.layer} failed")
        return self.real.scatter_copies(kv_caches, layers, *args, **kwargs)


@pytest.fixture
def engine() -> Iterator[CacheEngine]:
    config = load_config(engine_extra={"kvplug.chunk_size": 64, "kvplug.store.queue.mode": "sync"}, env={}).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="layerwise-faults")) as cache:
        yield cache


def worker_step(engine: CacheEngine, meta: KVPlugConnectorMetadata, caches: list[torch.Tensor]) -> set[int]:
    """One forward pass of a layer-wise worker; returns the block ids it reports as load errors."""
    parent = SimpleNamespace(has_connector_metadata=lambda: True, _get_connector_metadata=lambda: meta)
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_consumer=True, is_kv_producer=True))
    worker = WorkerSide(parent, vllm_config, ConnectorSettings(load="sync", layerwise=True), {}, ("lw", 0, 0))
    worker.engine, worker.kv_caches = engine, caches
    worker.layer_index = {name: index for index, name in enumerate(LAYERS)}
    try:
        worker.begin_step()
        worker.start_load_kv()
        for name in LAYERS:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name)
        worker.wait_for_save()
        return worker.get_block_ids_with_load_errors()
    finally:
        worker.engine = None  # the fixture closes the engine
        worker.background.close()


class RaisesOnWrite(RefusesLayer):
    """A connector whose copy into the cache raises something else than ``ConnectorError``
    (a device out of memory, a bug in a connector plugin)."""

    name: ClassVar[str] = "raises-on-write"

    def scatter_copies(self, kv_caches: Any, layers: range, *args: Any, **kwargs: Any) -> list[Callable[[], None]]:
        if self.layer in layers:
            raise RuntimeError("out of memory while staging the copy")
        return self.real.scatter_copies(kv_caches, layers, *args, **kwargs)


class RaisesOnRead(RefusesLayer):
    """A connector whose copy out of the cache (a store) raises."""

    name: ClassVar[str] = "raises-on-read"

    def gather_copies(self, *args: Any, **kwargs: Any) -> list[Callable[[], None]]:
        raise RuntimeError("out of memory while staging the copy")


@pytest.mark.parametrize("connector", [RefusesLayer, RaisesOnWrite], ids=["connector-error", "raises"])
@pytest.mark.parametrize("layer", [0, 1])
def test_a_layer_whose_write_failed_is_reported_and_its_step_stores_nothing(
    engine: CacheEngine, layer: int, connector: type[RefusesLayer]
) -> None:
    source = [torch.randn(16, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
    engine.store(PROMPT[:128], source, slots_from_block_ids(list(range(1, 5)), 32, 128))
    engine.connector = connector(engine.connector, layer)
    # vLLM loads the 128 cached tokens into blocks 8-11 and computes 128 more in blocks 12-15,
    # whose two chunks this step stores.
    request = RequestMeta(
        "r1",
        PROMPT,
        list(range(8, 16)),
        load=LoadSpec(num_computed=0, num_hit=128, num_external=128),
        save_start=128,
        save_end=256,
    )
    caches = [torch.zeros_like(layer_cache) for layer_cache in source]
    errors = worker_step(engine, KVPlugConnectorMetadata(requests=[request]), caches)
    assert errors == {8, 9, 10, 11}  # vLLM recomputes them (and the tokens computed on top of them)
    assert engine.lookup(PROMPT) == 128  # the chunks computed on top of the bad layer are not stored
    assert not any(engine.chain.contains_any(engine.record_keys(engine.chunk_keys(PROMPT, RequestInfo())[2:])))


def test_a_layerwise_store_whose_copy_raises_stores_nothing_and_the_pass_goes_on(engine: CacheEngine) -> None:
    engine.connector = RaisesOnRead(engine.connector, 0)
    request = RequestMeta("r1", PROMPT, list(range(8, 16)), save_start=0, save_end=256)
    caches = [torch.randn(16, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
    assert worker_step(engine, KVPlugConnectorMetadata(requests=[request]), caches) == set()
    assert engine.lookup(PROMPT) == 0


def test_a_background_load_of_several_groups_whose_write_raised_is_reported_failed(engine: CacheEngine) -> None:
    """A hybrid model's load is reported by request (``failed_recving``): one whose write raised
    must be failed (vLLM recomputes it), never reported loaded with unwritten blocks."""
    source = [torch.randn(16, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
    engine.store(PROMPT[:128], source, slots_from_block_ids(list(range(1, 5)), 32, 128))
    engine.connector = RaisesOnWrite(engine.connector, 0)
    caches = [torch.zeros_like(layer_cache) for layer_cache in source]
    blocks = list(range(8, 16))
    request = RequestMeta(
        "r-hybrid",
        PROMPT[:128],
        blocks,
        group_block_ids=[blocks],
        load=LoadSpec(num_computed=0, num_hit=128, num_external=128, background=True),
    )
    meta = KVPlugConnectorMetadata(requests=[request])
    parent = SimpleNamespace(has_connector_metadata=lambda: True, _get_connector_metadata=lambda: meta)
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_consumer=True, is_kv_producer=True))
    worker = WorkerSide(parent, vllm_config, ConnectorSettings(), {}, ("hybrid-write", 0, 0))
    worker.engine, worker.kv_caches = engine, caches
    # the groups of a hybrid model, here one engine for one group: the fetch is kvplug's own
    worker.groups = SimpleNamespace(fetch=lambda r: fetch_groups([(0, engine, caches)], r, [blocks]))  # type: ignore[assignment]
    try:
        worker.begin_step()
        worker.start_load_kv()
        deadline = time.monotonic() + 30
        finished: set[str] | None = None
        while not finished and time.monotonic() < deadline:
            finished = worker.get_finished(set())
        assert finished == {"r-hybrid"}
        assert worker.take_failed_loads() == {"r-hybrid"}
    finally:
        worker.groups = None
        worker.engine = None  # the fixture closes the engine
        worker.background.close()
