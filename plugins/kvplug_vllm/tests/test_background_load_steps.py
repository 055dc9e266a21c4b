"""Background loads through vLLM's own scheduler and kvplug's worker (real_scheduler.EngineLoop).

vLLM allocates a background load's blocks for the promised tokens only, and parks the request
until the load is in; a request it preempted comes back as a resumed request, not a new one.
"""

from __future__ import annotations

from conftest import tokens
from real_scheduler import BLOCK_SIZE, TOKEN_LAYOUT, EngineLoop, new_request, real_scheduler

#: 5 blocks and one token: two whole chunks (64 tokens each) and a partial one of 33.
PROMPT = tokens(51, 5 * BLOCK_SIZE + 1)
A = tokens(31, 300)  # 4 whole chunks and 44 tokens; 256 stored
C = tokens(32, 200)  # 3 whole chunks and 8 tokens; all stored
D = tokens(33, 230)


def test_a_full_prompt_hit_loaded_in_the_background_loads_what_its_blocks_hold_without_load_errors(
    tiny_model: str,
) -> None:
    """vLLM computes a prompt's last token whatever the hit, so kvplug promises one token less
    (plan.tokens_to_load). When that token begins a block of its own, the block is not
    allocated, though the chunk holding it (a partial one, ``save_unfull_chunk``) is in the hit."""
    unfull = {"save_unfull_chunk": True}
    loop_settings = dict(layout=TOKEN_LAYOUT, engine_settings=unfull, load="async", **unfull)
    with real_scheduler(tiny_model, "loop-bg-full", **loop_settings) as (scheduler, engine):
        loop = EngineLoop(scheduler, engine)
        loop.store(PROMPT)
        assert engine.lookup(PROMPT) == len(PROMPT)  # the whole prompt is cached, its last token too
        scheduler.add_request(new_request("full", PROMPT))
        errors: set[int] = set()
        promised = []
        for _ in range(200):
            if not scheduler.requests:
                break
            output, failed = loop.step()
            errors |= failed
            promised += [r.load.num_external for r in output.kv_connector_metadata.requests if r.load]
            if loop.worker.background.pending():
                loop.worker.background.wait(5.0)  # an event, not a timing: the fetch ends or fails
        assert not scheduler.requests
        # Base: the fetch needed 6 blocks for the 161 tokens of the hit and got the 5 vLLM allocated
        # for the 160 promised: a LayoutError, every block reported failed and recomputed.
        assert errors == set()
        assert promised == [128]  # the whole chunks the allocated blocks hold; vLLM computes the rest
        assert loop.misread == []
        assert loop.wrong_positions(PROMPT) == (len(PROMPT), [])


def test_a_preempted_request_reloaded_in_the_background_reports_both_loads(tiny_model: str) -> None:
    """vLLM schedules a request it preempted as a resumed one once its background load is in,
    not as a new one: that load's tokens count in its report as a synchronous reload's do."""
    with real_scheduler(tiny_model, "loop-bg-preempt", num_blocks=18, load="async") as (scheduler, engine):
        loop = EngineLoop(scheduler, engine, num_blocks=18)
        loop.store(C)
        loop.store(A[:256])
        scheduler.add_request(new_request("a", A, max_tokens=70, report=True))
        scheduler.add_request(new_request("c", C, max_tokens=70, report=True))
        preempted, loads = [], []
        for index in range(400):
            if not scheduler.requests:
                break
            if index == 5:
                scheduler.add_request(new_request("d", D, max_tokens=10, report=True))
            output, _ = loop.step()
            preempted += sorted(output.preempted_req_ids)
            loads += [(r.req_id, r.load.num_external) for r in output.kv_connector_metadata.requests if r.load]
            if loop.worker.background.pending():
                loop.worker.background.wait(5.0)  # an event, not a timing: the fetch ends or fails
        assert not scheduler.requests
        assert preempted == ["c"] and [r for r, _ in loads].count("c") == 2  # loaded, then reloaded
        for req_id in ("a", "c", "d"):
            report = loop.reports[req_id]["kvplug"]
            # Base: "c"'s reload, taken as a resumed request's step, was left out of its report.
            assert report["external_tokens"] == sum(n for r, n in loads if r == req_id), req_id
        assert loop.misread == []
        assert [loop.wrong_positions(p) for p in (A, C, D)] == [(256, []), (192, []), (192, [])]
