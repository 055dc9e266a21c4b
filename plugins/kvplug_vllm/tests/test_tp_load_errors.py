"""A load that fails on one tensor-parallel rank only: no rank stores what the step computed.

The ranks of a TP engine compute every token together (their attention outputs are summed by
an all-reduce), so when one rank's load of a prompt's first chunk fails (its record evicted,
corrupt, or past its deadline, on that rank alone), the KV every rank computes in that step
for the tokens after it is computed on top of a block that never held the prompt's KV. vLLM
recomputes the request (the scheduler sees the failed rank's report), but a rank whose own load
succeeded does not know: it stored its head records of the later chunks, and they stayed
(later stores skip a key the tier holds), to be loaded by every later request as the prompt's KV.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CHUNK_SIZE, kv_config, report, tokens
from oracle_support import captured_run
from record_files import chunk_records

from kvplug.testing import assert_kv_matches
from kvplug_vllm.load_results import LoadResults
from kvplug_vllm.metadata import LoadSpec, RequestMeta

PROMPT = tokens(61, 3 * CHUNK_SIZE + 10)
WHOLE = 3 * CHUNK_SIZE


def test_a_rank_takes_the_other_ranks_failed_loads_and_their_sharers_as_its_own() -> None:
    """Engine-free: this rank loaded everything; the other rank's load of request a's block 2
    failed. After the agreement this rank stores neither a nor b (it reads block 2 as context,
    vLLM's prefix cache shared it), and keeps a poisoned until vLLM rolled it back."""
    loader = RequestMeta("a", list(range(96)), [1, 2, 3], load=LoadSpec(num_computed=0, num_hit=64, num_external=64))
    loader.computes = (64, 96)
    sharer = RequestMeta("b", list(range(96)), [1, 2, 4], computes=(64, 96))
    other = RequestMeta("c", list(range(96)), [5, 6, 7], computes=(0, 96))
    step = [loader, sharer, other]
    here = LoadResults()
    their_flags = torch.tensor([1, 0, 0, 0, 1, 0], dtype=torch.int32)  # requests a, b, c failed; a's blocks 1, 2, 3 bad

    here.agree(step, lambda flags: flags + their_flags)
    here.refuse_sharers(step, 32)
    assert here.failed_this_step == {"a", "b"} and here.bad_blocks_this_step == {2}
    assert [here.may_store(r) for r in step] == [False, False, True]
    here.begin_step()  # the next step, scheduled before vLLM rolled a back
    assert not here.may_store(loader)


@pytest.mark.timeout(1800)  # three real engines with two worker processes each
def test_a_load_failing_on_one_rank_stores_nothing_on_any_rank(run_engine: Any, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    # sync loads: a failure is found in the step that computes on top of it (the default
    # `auto` loads memory tiers so; a disk tier keeps the test to one tier)
    kv = kv_config(**{"kvplug.load": "sync", "kvplug.tiers": [{"type": "disk", "path": str(store)}]})
    options = {"tensor_parallel_size": 2, "max_model_len": 1024}

    # The first chunk stored (one record per rank), then the prompt's own KV on top of it, stored nowhere.
    first = {"kvplug.skip_save": True}
    setup, (_, reference) = captured_run(
        run_engine, tmp_path, kv=kv, prompts=[PROMPT[:CHUNK_SIZE], PROMPT], params=[{}, first], **options
    )
    assert report(setup, 1)["hit_tokens"] == CHUNK_SIZE
    assert report(setup, 1)["totals"]["stored_tokens"] == CHUNK_SIZE  # the engine's tokens, not one count per rank
    records = chunk_records(store)
    assert len(records) == 2, records  # the first chunk: one record per rank

    # One rank's record of it is corrupt: that rank's load fails, the other's succeeds.
    data = bytearray(records[0].read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    records[0].write_bytes(bytes(data))

    run, (_, loaded) = captured_run(run_engine, tmp_path, kv=kv, prompts=[PROMPT, PROMPT], **options)
    assert report(run, 0)["totals"]["load_error_blocks"] > 0, report(run, 0)  # the failure happened
    again = report(run, 1)  # its totals are the engine's, the first request's failure included
    assert (
        again["hit_tokens"] == WHOLE
        and again["totals"]["load_error_blocks"] == report(run, 0)["totals"]["load_error_blocks"]
    )
    assert_kv_matches(loaded, reference, WHOLE)  # every rank's records hold the prompt's own KV
