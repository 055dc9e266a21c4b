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

import pytest
import torch
from real_scheduler import new_request, real_scheduler
from worker_steps import BLOCKS, PROMPT, StepDriver, stored, sync_engine

from kvplug import CacheEngine, slots_from_block_ids
from kvplug_vllm.metadata import LoadSpec, RequestMeta

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


@pytest.fixture
def engine() -> Iterator[CacheEngine]:
    with sync_engine("id-reuse") as cache:
        yield cache


def test_workers_forget_a_finished_id_before_the_step_that_reuses_it_loads_or_stores(engine: CacheEngine) -> None:
    driver = StepDriver(engine, "id-reuse")  # 2 chunks stored; lookups saw 4
    step = driver.step
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
        driver.close()
