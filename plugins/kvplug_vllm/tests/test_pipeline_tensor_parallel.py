"""kvplug in a real engine of two pipeline stages of two tensor-parallel ranks each (four workers).

Each worker (stage, rank) stores its own record of each chunk (its heads of its stage's layers)
and serves its own control socket; a second request of the prompt loads every worker's records,
each the KV that worker computed. The engine's first worker (stage 0, rank 0) alone publishes
kvplug's KV events: one per chunk, not one per worker. Failed loads on one stage:
test_pipeline_parallel.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK_SIZE, kv_config, output, report, tokens
from record_files import chunk_records
from test_kv_events import Subscriber
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvplug.testing import assert_kv_matches, load_slots

# one real engine with four worker processes
pytestmark = pytest.mark.timeout(1200)

WHOLE = 3 * CHUNK_SIZE
PROMPT = tokens(81, WHOLE + 10)
ENGINE = "pp-tp-engine"


def test_a_pp2_tp2_engine_loads_each_workers_records_and_each_worker_answers_kvplug_ctl(
    run_engine: Any, tmp_path: Path
) -> None:
    store = tmp_path / "kv"
    # Written on the saving step (sync queues): an async write landing after the engine's last step
    # would never have its "stored" published (events leave with a step's output).
    disk = {"type": "disk", "path": str(store), "queue": {"mode": "sync"}}
    kv = {**kv_config(**{"kvplug.tiers": [disk], "kvplug.store.queue.mode": "sync"}), "engine_id": ENGINE}
    steps = [{"prompts": [{"tokens": PROMPT}], "max_tokens": 4, "capture": str(tmp_path / f"kv-{i}")} for i in (0, 1)]
    # vLLM's prefix cache (on, for its KV events) emptied after the first request: the second loads from kvplug
    steps[0]["reset_prefix_cache"] = True
    steps[1].update(ctl_engine=ENGINE, ctl_lookups=[PROMPT])
    subscriber = Subscriber()
    try:
        run = run_engine(
            kv=kv,
            steps=steps,
            capture=True,
            pipeline_parallel_size=2,
            tensor_parallel_size=2,
            prefix_caching=True,
            kv_events={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": subscriber.endpoint},
        )
    finally:
        events = subscriber.close()

    assert report(run, 0)["hit_tokens"] == 0
    loaded = report(run, 1)
    assert loaded["hit_tokens"] == WHOLE and loaded["totals"]["load_error_blocks"] == 0, loaded
    # tokens are the engine's, counted once, not once per worker
    assert loaded["totals"]["stored_tokens"] == WHOLE and loaded["totals"]["loaded_tokens"] == WHOLE, loaded
    assert output(run, 1) == output(run, 0)
    assert len(chunk_records(store)) == 4 * WHOLE // CHUNK_SIZE  # one record per worker and chunk
    # each stage's ranks (their heads of the stage's layers) hold the KV the engine computed
    computed, again = (sorted(step["capture"]) for step in run["steps"][:2])
    for stage in ("pp0", "pp1"):
        stage_files = [(c, a) for c, a in zip(computed, again) if Path(c).name.split(".")[1] == stage]
        assert len(stage_files) == 2, computed
        reference = [s for c, _ in stage_files for s in load_slots(c)]
        assert_kv_matches([s for _, a in stage_files for s in load_slots(a)], reference, WHOLE)
    replies = run["steps"][1]["ctl_lookups"][0]["ranks"]
    assert len(replies) == 4, replies  # every worker answers
    assert [(r["pp_rank"], r["tp_rank"], r["hit_tokens"]) for r in replies] == [
        (0, 0, WHOLE),
        (0, 1, WHOLE),
        (1, 0, WHOLE),
        (1, 1, WHOLE),
    ], replies
    kvplug_events = [e for e in events if isinstance(e, (BlockStored, BlockRemoved)) and e.medium == "disk"]
    assert [type(e) for e in kvplug_events] == [BlockStored] * (WHOLE // CHUNK_SIZE), kvplug_events
    assert all(len(e.block_hashes) == CHUNK_SIZE // 32 for e in kvplug_events), kvplug_events
