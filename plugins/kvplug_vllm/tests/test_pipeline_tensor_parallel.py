"""kvplug in a real engine of two pipeline stages of two tensor-parallel ranks each (four workers).

Each worker (stage, rank) stores its own record of each chunk (its heads of its stage's layers)
and serves its own control socket; a second request of the prompt loads every worker's records,
each the KV that worker computed. Failed loads on one stage: test_pipeline_parallel.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK_SIZE, kv_config, output, report, tokens
from record_files import chunk_records

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
    kv = {**kv_config(**{"kvplug.tiers": [{"type": "disk", "path": str(store)}]}), "engine_id": ENGINE}
    steps = [{"prompts": [{"tokens": PROMPT}], "max_tokens": 4, "capture": str(tmp_path / f"kv-{i}")} for i in (0, 1)]
    steps[1].update(ctl_engine=ENGINE, ctl_lookups=[PROMPT])
    run = run_engine(
        kv=kv, steps=steps, capture=True, pipeline_parallel_size=2, tensor_parallel_size=2, max_model_len=1024
    )

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
    assert [(r["pp_rank"], r["tp_rank"], r["hit_tokens"]) for r in replies] == [
        (0, 0, WHOLE),
        (0, 1, WHOLE),
        (1, 0, WHOLE),
        (1, 1, WHOLE),
    ], replies
