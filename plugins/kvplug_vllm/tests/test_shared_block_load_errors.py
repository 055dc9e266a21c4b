"""A block that did not load is not stored by a request that shares it through vLLM's prefix cache.

vLLM caches a request's blocks as it allocates them, the blocks kvplug is to load included,
so a request admitted in the same step that shares the prefix takes them as computed. When
the load of one of them fails, vLLM rolls back every running request holding it; the worker
must refuse to store, in that step, every request holding it too: a chunk of the second
prompt that spans the block would keep, under that prompt's keys, KV that was never loaded
(and a later store of the same chunk is skipped: the tier holds it).

vLLM's own scheduler with KVPlugConnector, kvplug's worker side over a real cpu tier and
caches, and a stand-in model writing known KV into each scheduled slot (real_scheduler.py).
A record the lookup saw leaves the tier before the worker loads it, as an eviction by
another process sharing the tier would. The step after, with and without async scheduling
(the sharer computing on top of the bad block, or the first request computing it again):
the worker side fed that step's metadata, as in test_failed_load_stores.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import tokens
from real_scheduler import EngineLoop, new_request, real_scheduler

from kvplug import CacheEngine, Fingerprint, KVLayout, RequestInfo, load_config, slots_from_block_ids
from kvplug_vllm.layout import VLLM_CPU
from kvplug_vllm.metadata import KVPlugConnectorMetadata, LoadSpec, RequestMeta
from kvplug_vllm.settings import ConnectorSettings
from kvplug_vllm.worker import WorkerSide

A = tokens(21, 300)  # 4 whole chunks of 64, and 44 tokens
SHARER = A[:250] + tokens(22, 50)  # shares 250 tokens: 7 of A's blocks in vLLM's prefix cache


def test_a_request_sharing_a_block_whose_load_failed_stores_no_chunk_spanning_it(tiny_model: str) -> None:
    with real_scheduler(tiny_model, "shared-load-error") as (scheduler, engine):
        loop = EngineLoop(scheduler, engine)
        loop.store(A[:256])
        scheduler.add_request(new_request("a", A))
        scheduler.add_request(new_request("sharer", SHARER))

        def evict_chunk_3(output: Any) -> None:
            keys = engine.record_keys(engine.chunk_keys(A[:256], RequestInfo()))
            for tier in engine.chain.tiers:
                tier.remove([keys[3]])

        first, errors = loop.step(after_schedule=evict_chunk_3)
        sent = {
            r.req_id: (r.load.num_external if r.load else 0, r.save_start, r.save_end)
            for r in first.kv_connector_metadata.requests
        }
        assert sent == {"a": (256, 0, 0), "sharer": (0, 192, 256)}  # it computes from A's 7th block on
        assert errors == set(loop.blocks["a"][6:8])  # chunk 3: A's blocks 6 and 7, block 6 shared
        while scheduler.requests:
            loop.step()
        assert loop.misread == []  # every forward read the KV the model computes, loaded or not
        for prompt in (A, SHARER):
            hit, wrong = loop.wrong_positions(prompt)
            assert hit == 256 and wrong == []  # recomputed after vLLM's rollback, and stored right


LAYOUT = KVLayout(VLLM_CPU, num_layers=2, block_size=32, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
PROMPT = tokens(23, 300)
SHARES = PROMPT[:250] + tokens(24, 50)
BLOCKS = list(range(8, 18))  # the first request's 10 blocks; the sharer holds the first 8 of them


Step = Callable[..., set[int]]


@pytest.fixture
def worker_steps(request: pytest.FixtureRequest) -> Iterator[tuple[CacheEngine, list[torch.Tensor], Step]]:
    """A worker side over a real CacheEngine (cpu tier) and caches, and ``step(*requests)``: one
    step of vLLM's model runner with that metadata, returning the step's load errors. Indirect
    parameter: vLLM's ``max_concurrent_batches`` (default 2: async scheduling)."""
    config = load_config(engine_extra={"kvplug.chunk_size": 64, "kvplug.store.queue.mode": "sync"}, env={}).config
    source = [torch.randn(32, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
    meta = KVPlugConnectorMetadata()
    parent = SimpleNamespace(has_connector_metadata=lambda: True, _get_connector_metadata=lambda: meta)
    roles = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(is_kv_consumer=True, is_kv_producer=True),
        max_concurrent_batches=getattr(request, "param", 2),
    )
    worker = WorkerSide(parent, roles, ConnectorSettings(load="sync"), {}, ("shared-next-step", 0, 0))

    def step(*requests: RequestMeta) -> set[int]:
        meta.requests = list(requests)
        worker.begin_step()
        worker.start_load_kv()
        worker.wait_for_save()
        worker.get_finished(set())
        return worker.get_block_ids_with_load_errors()

    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="shared-next-step")) as engine:
        worker.engine, worker.kv_caches = engine, source
        try:
            yield engine, source, step
        finally:
            worker.engine = None  # closed by the with block
            worker.background.close()


def stored_chunks(engine: CacheEngine, prompt: list[int]) -> list[bool]:
    return engine.chain.contains_any(engine.record_keys(engine.chunk_keys(prompt, RequestInfo())))


@pytest.mark.parametrize("scheduling", ["async", "sync"])
def test_the_next_step_of_a_sharer_stores_nothing_read_from_a_block_nobody_computed_again(
    worker_steps: tuple[CacheEngine, list[torch.Tensor], Step], scheduling: str
) -> None:
    """Async scheduling: step N+1 was scheduled before vLLM saw step N's load errors, so the sharer
    (not in step N's metadata: it stored nothing there) computes on top of the bad block. Without it,
    vLLM had the first request compute the block again in N+1, for the sharer too."""
    engine, source, step = worker_steps
    engine.store(PROMPT[:192], source, slots_from_block_ids(BLOCKS, 32, 192))  # 3 chunks; the lookup saw 4
    sharer = [*BLOCKS[:8], 30, 31]
    load = LoadSpec(num_computed=0, num_hit=256, num_external=256)
    # step N: the first request's chunk 3 (blocks 14, 15) does not load; the sharer computes 240..250
    assert step(RequestMeta("a", PROMPT, BLOCKS, load=load, computes=(256, 300))) == {14, 15}
    if scheduling == "async":  # N+1: "a" decodes, the sharer completes its chunk 3 over block 14
        a_next = RequestMeta("a", PROMPT, BLOCKS, computes=(300, 301))
    else:  # N+1: vLLM rolled "a" back to block 14, and it computes it again
        a_next = RequestMeta("a", PROMPT, BLOCKS, save_start=192, save_end=256, computes=(192, 300), epoch=1)
    assert step(a_next, RequestMeta("s", SHARES, sharer, save_start=192, save_end=256, computes=(250, 256))) == set()
    assert stored_chunks(engine, SHARES[:256])[3] is (scheduling == "sync")


def test_blocks_that_did_not_load_given_to_a_new_request_that_loads_into_them_are_no_ones_context(
    worker_steps: tuple[CacheEngine, list[torch.Tensor], Step],
) -> None:
    engine, source, step = worker_steps
    engine.store(PROMPT[:192], source, slots_from_block_ids(BLOCKS, 32, 192))
    other = tokens(25, 360)
    engine.store(other[:256], source, slots_from_block_ids(list(range(20, 28)), 32, 256))
    load = LoadSpec(num_computed=0, num_hit=256, num_external=256)
    assert step(RequestMeta("a", PROMPT, BLOCKS, load=load, computes=(256, 300))) == {14, 15}
    # "a" aborted: vLLM gives blocks 14 and 15 to "b", whose own load fills them in this step
    reused = [20, 21, 22, 23, 24, 25, 14, 15, 26, 27, 28]
    b = RequestMeta("b", other, reused, load=load, save_start=256, save_end=320, computes=(256, 330))
    assert step(b) == set()
    assert stored_chunks(engine, other[:320]) == [True] * 5  # its chunk 4 too


@pytest.mark.parametrize("worker_steps", [3], indirect=True)
def test_with_three_steps_in_flight_a_sharer_stores_nothing_read_from_a_bad_block_two_steps_later(
    worker_steps: tuple[CacheEngine, list[torch.Tensor], Step],
) -> None:
    """Pipeline parallelism (``pp`` steps in flight, ``pp + 1`` with async scheduling): steps N+1
    and N+2 were scheduled before vLLM saw step N's load errors. The sharer, in no metadata in
    N and N+1 (it completes no chunk there), completes its chunk 3 over the bad block in N+2."""
    engine, source, step = worker_steps
    engine.store(PROMPT[:192], source, slots_from_block_ids(BLOCKS, 32, 192))  # 3 chunks; the lookup saw 4
    sharer = [*BLOCKS[:8], 30, 31]
    load = LoadSpec(num_computed=0, num_hit=256, num_external=256)
    assert step(RequestMeta("a", PROMPT, BLOCKS, load=load, computes=(256, 300))) == {14, 15}  # N
    assert step() == set()  # N+1: "a" decodes, the sharer computes 240..245: neither loads nor stores
    s = RequestMeta("s", SHARES, sharer, save_start=192, save_end=256, computes=(245, 256))
    assert step(s) == set()  # N+2
    assert stored_chunks(engine, SHARES[:256])[3] is False
    # N+3: vLLM rolled both back; "a" computes blocks 14 and 15 again, the sharer its chunk 3
    a_again = RequestMeta("a", PROMPT, BLOCKS, save_start=192, save_end=256, computes=(192, 300), epoch=1)
    s_again = RequestMeta("s", SHARES, sharer, save_start=192, save_end=256, computes=(240, 256), epoch=1)
    assert step(a_again, s_again) == set()
    assert stored_chunks(engine, SHARES[:256])[3] is True
