"""Every way vLLM lets go of a request, the connector's scheduler side forgets it.

The scheduler side keeps a state per request from its first lookup on (and a lookup in
flight, with ``background_lookups``) and forgets it only in ``request_finished``. vLLM
0.32's ``Scheduler`` removes a request from its books only in ``_free_blocks``, reached
through ``_free_request`` (which calls the connector's ``request_finished`` first) or, for a
request whose blocks it kept for a transfer, once the workers report that transfer done.
Every path that ends a request goes through ``_free_request``: a stop (length, stop token,
a pooling request's output, a grammar rejecting a token) in ``update_from_output``, and
``finish_requests`` for aborts (one request, or all of them) and errors (a grammar that
failed to compile, an encoder cache mismatch, a failed KV load under
``kv_load_failure_policy: fail``). Paths that keep a request do not call it, and must not
lose its state: a preemption, a rollback after a failed load (``recompute``), the next turn
of a streaming-input session.

These tests drive vLLM's own ``Scheduler`` (real_scheduler.py) down each path that a test
can reach without a model or a grammar, and check that afterwards vLLM holds no request
nor block and kvplug no request state; where vLLM keeps the request, kvplug keeps its state.
"""

from __future__ import annotations

from typing import Any

import torch
from conftest import tokens
from real_scheduler import BLOCK_SIZE, EngineLoop, new_request, real_scheduler, run_turn, session_turn

from kvplug import RequestInfo

A = tokens(51, 300)  # 4 whole chunks of 64 and 44 tokens
B = tokens(52, 200)  # 3 whole chunks and 8 tokens
C = tokens(53, 230)


def kvplug_requests(scheduler: Any) -> list[str]:
    """The requests the connector's scheduler side keeps state or a lookup for."""
    side = scheduler.connector._scheduler_side()
    pool = side.lookups.pool
    return sorted(set(side._states) | (set(pool._entries) if pool is not None else set()))


def assert_all_let_go(scheduler: Any) -> None:
    assert not scheduler.requests, f"vLLM still holds {sorted(scheduler.requests)}"
    assert scheduler.kv_cache_manager.usage == 0, "vLLM still holds blocks"
    assert kvplug_requests(scheduler) == [], "kvplug's scheduler side kept the state of finished requests"


def run_to_the_end(loop: EngineLoop, steps: int = 400) -> None:
    for _ in range(steps):
        if not loop.scheduler.requests:
            return
        loop.step()
    raise AssertionError(f"requests left after {steps} steps: {sorted(loop.scheduler.requests)}")


def test_requests_that_stop_are_forgotten(tiny_model: str) -> None:
    """A stop at max_tokens, of requests that loaded from kvplug and of one that missed."""
    with real_scheduler(tiny_model, "life-stop") as (scheduler, engine):
        loop = EngineLoop(scheduler, engine)
        loop.store(A[:256])
        for req_id, prompt in (("hit", A), ("shares", A[:200] + B[:50]), ("miss", C)):
            scheduler.add_request(new_request(req_id, prompt, max_tokens=3))
        loop.step()
        assert kvplug_requests(scheduler) == ["hit", "miss", "shares"]
        run_to_the_end(loop)
        assert_all_let_go(scheduler)
        assert loop.misread == []


def test_aborts_of_waiting_running_and_preempted_requests_are_forgotten(tiny_model: str) -> None:
    """``finish_requests`` of one request in each place vLLM keeps it: waiting after its lookup
    (no blocks for it yet), preempted back to waiting, and running; the preemption itself
    keeps its state."""
    from vllm.v1.request import RequestStatus

    # 17 usable blocks: "a" takes 10 to 12 of them, "w" needs 8 at once, "c" 7 growing to 9
    with real_scheduler(tiny_model, "life-abort", num_blocks=18) as (scheduler, engine):
        loop = EngineLoop(scheduler, engine, num_blocks=18)
        loop.store(B)
        loop.store(C)
        scheduler.add_request(new_request("a", A, max_tokens=70))
        loop.step()
        scheduler.add_request(new_request("w", C, max_tokens=70))
        loop.step()  # "w" is looked up (a hit), and waits: no 8 blocks free
        assert scheduler.requests["w"].status == RequestStatus.WAITING
        assert kvplug_requests(scheduler) == ["a", "w"]
        scheduler.finish_requests("w", RequestStatus.FINISHED_ABORTED)
        assert kvplug_requests(scheduler) == ["a"], "a waiting request aborted after its lookup was kept"

        scheduler.add_request(new_request("c", B, max_tokens=70))
        preempted: list[str] = []
        for _ in range(200):
            output, _ = loop.step()
            preempted += sorted(output.preempted_req_ids)
            if preempted:
                break
        assert preempted == ["c"]
        assert scheduler.requests["c"].status == RequestStatus.PREEMPTED
        assert kvplug_requests(scheduler) == ["a", "c"], "a preempted request's state was dropped"
        scheduler.finish_requests("c", RequestStatus.FINISHED_ABORTED)
        assert kvplug_requests(scheduler) == ["a"], "an aborted preempted request was kept"
        scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
        assert kvplug_requests(scheduler) == [], "an aborted running request was kept"
        loop.step()  # the step that names them finished to the workers
        assert_all_let_go(scheduler)
        assert loop.misread == []


def test_aborting_every_request_forgets_them_all(tiny_model: str) -> None:
    """``finish_requests(None)``: what the engine core does at shutdown and on a pause that aborts."""
    from vllm.v1.request import RequestStatus

    with real_scheduler(tiny_model, "life-abort-all", max_num_batched_tokens=128) as (scheduler, engine):
        loop = EngineLoop(scheduler, engine)
        loop.store(A[:256])
        for req_id, prompt in (("a", A), ("b", B), ("c", C)):
            scheduler.add_request(new_request(req_id, prompt, max_tokens=20))
        loop.step()  # 128 tokens a step: "a" loads and runs, the others are looked up or wait
        scheduler.add_request(new_request("new", A[:100]))  # not looked up yet
        assert set(kvplug_requests(scheduler)) >= {"a"}
        aborted = scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        assert sorted(r.request_id for r in aborted) == ["a", "b", "c", "new"]
        loop.step()
        assert_all_let_go(scheduler)


def test_a_request_aborted_while_its_background_load_runs_is_forgotten_and_its_blocks_freed(
    tiny_model: str,
) -> None:
    """An abort while the request waits for its KV (WAITING_FOR_REMOTE_KVS): vLLM calls
    request_finished at once but keeps the blocks until the workers report the load done."""
    from vllm.v1.request import RequestStatus

    with real_scheduler(tiny_model, "life-abort-loading", load="async") as (scheduler, engine):
        loop = EngineLoop(scheduler, engine)
        loop.store(A[:256])
        scheduler.add_request(new_request("a", A))

        def abort(output: Any) -> None:
            [sent] = output.kv_connector_metadata.requests
            assert sent.load is not None and sent.load.background
            assert scheduler.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
            scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # the client went away
            assert kvplug_requests(scheduler) == []

        loop.step(after_schedule=abort)
        for _ in range(50):  # until the workers report the load: vLLM frees the blocks then
            if not scheduler.requests:
                break
            loop.step()
        assert_all_let_go(scheduler)


def evict_chunk(engine: Any, prompt: list[int], index: int) -> None:
    """Remove a stored chunk from every tier, as another process sharing the tier evicting it would."""
    keys = engine.record_keys(engine.chunk_keys(prompt, RequestInfo()))
    for tier in engine.chain.tiers:
        tier.remove([keys[index]])


def test_a_request_failed_by_its_kv_load_is_forgotten_and_one_rolled_back_is_kept(tiny_model: str) -> None:
    """A load that fails between the lookup and the worker: under ``kv_load_failure_policy:
    recompute`` vLLM rolls the request back and it goes on (its state kept); under ``fail``
    vLLM finishes it with an error (``finish_requests``), which forgets it."""
    for policy in ("recompute", "fail"):
        with real_scheduler(tiny_model, f"life-load-{policy}") as (scheduler, engine):
            # What vLLM's Scheduler derives from kv_load_failure_policy at start (real_scheduler.py
            # builds it with "recompute").
            scheduler.recompute_kv_load_failures = policy == "recompute"
            loop = EngineLoop(scheduler, engine)
            loop.store(A[:256])
            scheduler.add_request(new_request("a", A))
            _, errors = loop.step(after_schedule=lambda _: evict_chunk(engine, A[:256], 3))
            assert errors, "the load did not fail"
            if policy == "recompute":
                assert "a" in scheduler.requests and kvplug_requests(scheduler) == ["a"]
                run_to_the_end(loop)
                assert loop.misread == []
            else:
                assert "a" not in scheduler.requests and kvplug_requests(scheduler) == []
                loop.step()
            assert_all_let_go(scheduler)


def test_a_pooling_request_that_stops_with_its_output_is_forgotten(tiny_model: str) -> None:
    """A pooling request (prefill only) stops as soon as the runner returns its pooled output."""
    from vllm import PoolingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    with real_scheduler(tiny_model, "life-pooling") as (scheduler, engine):
        EngineLoop(scheduler, engine).store(A[:256])
        hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        scheduler.add_request(Request("embed", A, None, PoolingParams(), block_hasher=hasher))
        output = scheduler.schedule()
        assert kvplug_requests(scheduler) == ["embed"]
        assert output.num_scheduled_tokens == {"embed": 300 - 256}  # the rest loaded from kvplug
        runner = ModelRunnerOutput(
            req_ids=["embed"],
            req_id_to_index={"embed": 0},
            sampled_token_ids=[[]],
            pooler_output=[torch.zeros(8)],
            kv_connector_output=KVConnectorOutput(),
        )
        scheduler.update_from_output(output, runner)
        scheduler.schedule()
        assert_all_let_go(scheduler)


def test_a_streaming_input_session_keeps_its_state_between_turns_and_is_forgotten_at_its_end(
    tiny_model: str,
) -> None:
    """A resumable request (streaming input) stops after each turn and waits for the next
    under the same id: vLLM keeps it, and so does kvplug, whose stores then cover the longer
    prompt. A last add_request that is not resumable ends the session (``finish_requests``)."""
    with real_scheduler(tiny_model, "life-streaming") as (scheduler, engine):
        loop = EngineLoop(scheduler, engine)
        scheduler.add_request(session_turn(A[:100]))
        run_turn(loop)
        assert kvplug_requests(scheduler) == ["s"], "a session's state was dropped between turns"
        scheduler.add_request(session_turn(B))  # the next turn: its prompt follows the first turn's tokens
        run_turn(loop)
        session = list(scheduler.requests["s"].prompt_token_ids)
        assert len(session) == 302 and kvplug_requests(scheduler) == ["s"]
        assert loop.wrong_positions(session) == (256, [])  # the longer prompt's chunks, as computed
        scheduler.add_request(session_turn([], resumable=False))  # the end of the session's input
        loop.step()
        assert_all_let_go(scheduler)
        assert loop.misread == []


def test_a_session_preempted_in_a_later_turn_loads_its_earlier_chunks_back_as_computed(tiny_model: str) -> None:
    """A streaming-input session preempted during its second turn (another request's blocks
    grew) comes back as a new lookup of the whole session's prompt, keyed as it is now
    (``RequestState.follow``), and loads the chunks both turns stored in the background
    (``load: async``): every slot the session reads holds what the model computed there."""
    from vllm.v1.request import RequestStatus

    # 17 usable blocks: "a" takes 7 growing to 16, the session 4, then 7 growing to 10
    with real_scheduler(tiny_model, "life-session-preempted", num_blocks=18, load="async") as (scheduler, engine):
        loop = EngineLoop(scheduler, engine, num_blocks=18)
        scheduler.add_request(new_request("a", C[:200], max_tokens=300))
        loop.step()
        scheduler.add_request(session_turn(A[:100]))
        run_turn(loop)
        scheduler.add_request(session_turn(B[:100], max_tokens=100))
        preempted: list[str] = []
        for _ in range(600):
            output, _ = loop.step()
            preempted += sorted(output.preempted_req_ids)
            if scheduler.requests["s"].status == RequestStatus.WAITING_FOR_STREAMING_REQ:
                break
        assert "s" in preempted, "the session was not preempted in its second turn"
        assert scheduler.requests["s"].status == RequestStatus.WAITING_FOR_STREAMING_REQ
        session = list(scheduler.requests["s"].prompt_token_ids)
        assert loop.wrong_positions(session) == (192, []), "the session's chunks are not the KV computed"
        assert loop.misread == [], "a forward read KV other than the model's"
        # the resumed lookup's hit past vLLM's own prefix cache (its first block), loaded by kvplug
        assert scheduler.connector._scheduler_side().totals.reduce()["hit_tokens"] == 192 - BLOCK_SIZE
