"""A block that did not load and that a request computes again in the next step is fine for its
sharers, even where that request stores nothing in that step (it is in no request's metadata).

vLLM rolls back the first holder of a block whose load failed and has it compute the block again
for every request sharing it through vLLM's prefix cache; a sharer that completes a chunk spanning
the block in that step stores KV read from the block as computed again. The recomputing request
stores nothing when its own settings say so (``kvplug.skip_save``), or when its step completes no
chunk: without it in the metadata the worker took the block for still bad, refused the sharer and
kept refusing its stores (misses for every later request of that prompt, never wrong KV).

vLLM's own scheduler with KVPlugConnector, kvplug's worker side over a real cpu tier and caches,
and a stand-in model writing known KV into each scheduled slot (real_scheduler.py).
"""

from __future__ import annotations

from typing import Any

from conftest import tokens
from real_scheduler import EngineLoop, new_request, real_scheduler

from kvplug import RequestInfo

A = tokens(31, 300)  # 4 whole chunks of 64, and 44 tokens
SHARER = A[:250] + tokens(32, 50)  # shares 250 tokens: 7 of A's blocks in vLLM's prefix cache


def test_a_sharer_stores_a_chunk_over_a_block_its_first_holder_computed_again_without_storing(
    tiny_model: str,
) -> None:
    with real_scheduler(tiny_model, "recomputed-block-sharers") as (scheduler, engine):
        loop = EngineLoop(scheduler, engine)
        loop.store(A[:256])
        a = new_request("a", A)
        a.kv_transfer_params = {"kvplug.skip_save": True}  # loads, stores nothing
        scheduler.add_request(a)
        scheduler.add_request(new_request("sharer", SHARER))

        def evict_chunk_3(output: Any) -> None:
            keys = engine.record_keys(engine.chunk_keys(A[:256], RequestInfo()))
            for tier in engine.chain.tiers:
                tier.remove([keys[3]])

        _, errors = loop.step(after_schedule=evict_chunk_3)
        assert errors == set(loop.blocks["a"][6:8])  # chunk 3: A's blocks 6 and 7, block 6 shared
        second, _ = loop.step()  # "a" computes blocks 6 and 7 again; the sharer its chunk 3 over block 6
        assert {r.req_id for r in second.kv_connector_metadata.requests} == {"sharer"}
        while scheduler.requests:
            loop.step()
        assert loop.misread == []
        hit, wrong = loop.wrong_positions(SHARER)
        assert (hit, wrong) == (256, [])  # its chunk 3 stored, as computed
