"""A request id reused as soon as its request finished (vLLM with
``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``, or a caller of the engine core) is a new request.

vLLM calls ``request_finished`` when a request finishes, and names it once more in the
next step's ``finished_req_ids``: by then a new request may hold the id, looked up and
admitted in that very step. Its state must not be dropped with the old one's: vLLM counts
the hit as computed, so a load missing from the metadata leaves the forward pass reading
blocks nobody wrote. Nor may the workers drop, after that step's load, what they keep of
the new request (a failed load's ban on stores), or keep the old one's for it.

The scheduler side runs in vLLM's own ``Scheduler`` (real_scheduler.py); the worker side
over a real CacheEngine and caches, fed the metadata of those steps (as in
test_failed_load_stores.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from real_scheduler import new_request, real_scheduler

from kvplug import CacheEngine, Fingerprint, KVLayout, RequestInfo, load_config, slots_from_block_ids
from kvplug_vllm.layout import VLLM_CPU
from kvplug_vllm.metadata import KVPlugConnectorMetadata, LoadSpec, RequestMeta
from kvplug_vllm.settings import ConnectorSettings
from kvplug_vllm.worker import WorkerSide

A = list(range(3, 203))  # 3 whole chunks of 64 and 8 tokens
B = list(range(1003, 1203))  # another prompt of the same length, nothing shared


def test_a_reused_id_admitted_in_the_step_after_its_finish_keeps_its_load(tiny_model: str) -> None:
    from vllm.v1.request import RequestStatus

    with real_scheduler(tiny_model, "id-reuse") as (scheduler, engine):
        caches = [torch.randn(16, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
        for prompt in (A, B):
            engine.store(prompt, caches, slots_from_block_ids(list(range(1, 16)), 32, len(prompt)))
        scheduler.add_request(new_request("x", A))
        first = scheduler.schedule()
        assert [(r.req_id, r.load.num_external if r.load else 0) for r in first.kv_connector_metadata.requests] == [
            ("x", 192)
        ]
        scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)  # the client went away
        scheduler.add_request(new_request("x", B))  # and the id came back at once
        second = scheduler.schedule()
        assert second.finished_req_ids == {"x"}
        [admitted] = second.scheduled_new_reqs
        assert admitted.num_computed_tokens == 192  # vLLM counts kvplug's 192 tokens as computed
        meta = second.kv_connector_metadata
        loads = [(r.req_id, r.token_ids[:3], r.load.num_external if r.load else 0) for r in meta.requests]
        assert loads == [("x", B[:3], 192)]
        assert meta.finished_req_ids == ["x"]  # the workers forget the old "x" before this load


LAYOUT = KVLayout(VLLM_CPU, num_layers=2, block_size=32, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
PROMPT = list(range(3, 515))  # 8 chunks of 64
BLOCKS = list(range(8, 24))


@pytest.fixture
def engine() -> Iterator[CacheEngine]:
    config = load_config(engine_extra={"kvplug.chunk_size": 64, "kvplug.store.queue.mode": "sync"}, env={}).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="id-reuse")) as cache:
        yield cache


def stored(engine: CacheEngine) -> list[bool]:
    keys = engine.record_keys(engine.chunk_keys(PROMPT, RequestInfo()))
    return engine.chain.contains_any(keys)


def test_workers_forget_a_finished_id_before_the_step_that_reuses_it_loads_or_stores(engine: CacheEngine) -> None:
    source = [torch.randn(32, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
    engine.store(PROMPT[:128], source, slots_from_block_ids(BLOCKS, 32, 128))  # 2 chunks; lookups saw 4
    meta = KVPlugConnectorMetadata()
    parent = SimpleNamespace(has_connector_metadata=lambda: True, _get_connector_metadata=lambda: meta)
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_consumer=True, is_kv_producer=True))
    worker = WorkerSide(parent, vllm_config, ConnectorSettings(load="sync"), {}, ("id-reuse", 0, 0))
    worker.engine, worker.kv_caches = engine, source

    def step(request: RequestMeta, finished: frozenset[str] = frozenset()) -> set[int]:
        """One step as vLLM's model runner drives it (bind, load, forward, save, results)."""
        meta.requests, meta.finished_req_ids = [request], sorted(finished)
        worker.begin_step()
        worker.start_load_kv()
        worker.wait_for_save()
        worker.get_finished(set(finished))
        return worker.get_block_ids_with_load_errors()

    load = LoadSpec(num_computed=0, num_hit=256, num_external=256)
    try:
        # the old "x": its load fails (chunks 2-3 are gone), and it is aborted before vLLM rolls it back
        assert step(RequestMeta("x", PROMPT, BLOCKS, load=load)) == {12, 13, 14, 15}
        # the new "x", in the next step: its own stores are not the old one's to ban
        assert step(RequestMeta("x", PROMPT, BLOCKS, save_start=128, save_end=192), finished=frozenset({"x"})) == set()
        assert stored(engine) == [True, True, True] + [False] * 5
        # a new "x" whose own load fails in the step that names the old one finished ...
        assert step(RequestMeta("y", PROMPT, BLOCKS, load=load), finished=frozenset({"y"})) == {14, 15}
        # ... computes its next chunk on top of the blocks that did not load before vLLM rolls it
        # back (async scheduling): that is not stored
        assert step(RequestMeta("y", PROMPT, BLOCKS, save_start=256, save_end=320)) == set()
        assert stored(engine) == [True, True, True] + [False] * 5
    finally:
        worker.engine = None  # the fixture closes the engine
        worker.background.close()
