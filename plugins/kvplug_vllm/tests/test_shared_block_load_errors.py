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
another process sharing the tier would.
"""

from __future__ import annotations

from typing import Any

from conftest import tokens
from real_scheduler import EngineLoop, new_request, real_scheduler

from kvplug import RequestInfo

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
