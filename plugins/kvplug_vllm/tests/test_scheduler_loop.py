"""Loads and stores through vLLM's own scheduler under pressure, checked slot by slot.

vLLM's ``Scheduler`` with KVPlugConnector and kvplug's worker side in one loop
(real_scheduler.py): a stand-in model writes known KV into each scheduled slot, every
forward checks the KV it reads (loaded by kvplug, shared through vLLM's prefix cache, or
computed), and at the end each prompt's cached prefix is loaded into fresh caches and
compared. Cheaper than an engine per case, with vLLM's real admission, chunked prefill,
preemption and rollback decisions.
"""

from __future__ import annotations

from conftest import tokens
from real_scheduler import EngineLoop, new_request, real_scheduler

A = tokens(31, 300)  # 4 whole chunks and 44 tokens; 256 stored
C = tokens(32, 200)  # 3 whole chunks and 8 tokens; all stored
D = tokens(33, 230)


def test_a_preempted_request_resumes_from_vllms_cache_and_kvplugs_with_the_models_kv(tiny_model: str) -> None:
    # 17 blocks: A and C both decode 70 tokens; D arriving later takes C's freed blocks
    with real_scheduler(tiny_model, "loop-preempt", num_blocks=18) as (scheduler, engine):
        loop = EngineLoop(scheduler, engine, num_blocks=18)
        loop.store(C)
        loop.store(A[:256])
        scheduler.add_request(new_request("a", A, max_tokens=70))
        scheduler.add_request(new_request("c", C, max_tokens=70))
        preempted, reloads = [], []
        for index in range(400):
            if not scheduler.requests:
                break
            if index == 5:
                scheduler.add_request(new_request("d", D, max_tokens=10))
            output, _ = loop.step()
            preempted += sorted(output.preempted_req_ids)
            reloads += [(r.req_id, r.epoch) for r in output.kv_connector_metadata.requests if r.load and r.epoch]
        assert preempted == ["c"] and reloads == [("c", 1)]  # resumed with a load of what vLLM evicted
        assert loop.misread == []
        assert [loop.wrong_positions(p) for p in (A, C, D)] == [(256, []), (192, []), (192, [])]


def test_chunked_prefill_of_a_few_tokens_a_step_loads_once_and_stores_each_chunk_it_completes(
    tiny_model: str,
) -> None:
    with real_scheduler(tiny_model, "loop-chunked", max_num_batched_tokens=48) as (scheduler, engine):
        loop = EngineLoop(scheduler, engine)
        loop.store(A[:128])
        scheduler.add_request(new_request("a", A))
        scheduler.add_request(new_request("exact", A[:64]))  # a prompt of exactly one chunk
        scheduler.add_request(new_request("short", tokens(34, 40)))  # shorter than a chunk: nothing to do
        sent = []
        while scheduler.requests:
            output, _ = loop.step()
            sent += [
                (r.req_id, r.load.num_external if r.load else 0, r.save_start, r.save_end)
                for r in output.kv_connector_metadata.requests
            ]
        # 48 tokens a step: "exact" waits for "a"'s prefill and finds A's first block in vLLM's own
        # prefix cache, then kvplug's chunk past it, less the token vLLM computes to sample from
        assert sent == [("a", 128, 0, 0), ("a", 0, 128, 192), ("a", 0, 192, 256), ("exact", 31, 0, 0)]
        assert loop.misread == []
        assert loop.wrong_positions(A) == (256, [])


def test_requests_sharing_a_prefix_in_one_step_load_it_once_and_store_each_their_own_chunks(tiny_model: str) -> None:
    with real_scheduler(tiny_model, "loop-shared") as (scheduler, engine):
        loop = EngineLoop(scheduler, engine)
        loop.store(A[:192])
        prompts = {f"r{i}": A[: 150 + 40 * i] + tokens(40 + i, 30) for i in range(4)}
        for req_id, prompt in prompts.items():
            scheduler.add_request(new_request(req_id, prompt))
        first, _ = loop.step()
        loads = {r.req_id: r.load.num_external for r in first.kv_connector_metadata.requests if r.load}
        # vLLM caches each request's blocks as it allocates them: a later request of the same step
        # takes those as computed, and kvplug loads only what none of them holds
        computed = {new.req_id: new.num_computed_tokens for new in first.scheduled_new_reqs}
        assert (loads, computed) == ({"r0": 128, "r2": 32}, {"r0": 128, "r1": 128, "r2": 192, "r3": 224})
        while scheduler.requests:
            loop.step()
        assert loop.misread == []
        hits = {req_id: loop.wrong_positions(prompt) for req_id, prompt in prompts.items()}
        assert hits == {"r0": (128, []), "r1": (192, []), "r2": (256, []), "r3": (256, [])}
