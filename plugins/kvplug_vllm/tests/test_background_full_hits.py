"""A background load of a hit that covers the whole prompt, through vLLM's own scheduler.

vLLM computes a prompt's last token whatever the hit, so kvplug promises one token less
(plan.tokens_to_load), and for a background load vLLM allocates blocks for the promised
tokens only. When the prompt's last token starts a block of its own, that block is not
allocated, though the chunk holding the token (a partial chunk, ``save_unfull_chunk``)
is part of the hit.
"""

from __future__ import annotations

from conftest import tokens
from real_scheduler import BLOCK_SIZE, TOKEN_LAYOUT, EngineLoop, new_request, real_scheduler

#: 5 blocks and one token: two whole chunks (64 tokens each) and a partial one of 33.
PROMPT = tokens(51, 5 * BLOCK_SIZE + 1)


def test_a_full_prompt_hit_loaded_in_the_background_loads_what_its_blocks_hold_without_load_errors(
    tiny_model: str,
) -> None:
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
