"""kvplug's counters beside vLLM's own prefix cache, on a real engine.

vLLM's prefix cache answers before kvplug: tokens it already has are not loaded by
kvplug, and kvplug's hit counters must not claim them. They are counted apart
(``vllm_cached_tokens``); ``hit_tokens`` are the tokens kvplug adds, and loads.
The prefix cache reset empties kvplug's memory tiers (the ``cpu`` tier, by its
medium) and keeps the disk tier, from which the prompt then loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import kv_config, output, report, step


def test_tokens_vllm_had_already_are_not_kvplug_hits(
    run_engine: Any, baseline: dict[str, list[int]], tmp_path: Path
) -> None:
    tiers = [{"type": "cpu"}, {"type": "disk", "path": str(tmp_path / "disk"), "max_bytes": "64MiB"}]
    kv = kv_config(**{"kvplug.tiers": tiers})
    steps = [step("P1"), {**step("P1"), "reset_prefix_cache": True}, step("P1")]
    result = run_engine(kv=kv, steps=steps, prefix_caching=True)
    assert [output(result, i) for i in range(3)] == [baseline["P1"]] * 3

    # 2nd request: vLLM's prefix cache has the prompt's 9 whole blocks (288 tokens); kvplug
    # holds 4 chunks (256 tokens) of it, all of them tokens vLLM computed already.
    second = report(result, 1)
    assert (second["hit_tokens"], second["external_tokens"]) == (0, 0)
    assert second["totals"]["hit_tokens"] == 0 and second["totals"]["loaded_tokens"] == 0
    assert second["vllm_cached_tokens"] == second["totals"]["vllm_cached_tokens"] == 256

    # reset_prefix_cache: vLLM's cache and kvplug's memory tier are empty, the disk tier is not
    assert result["steps"][1]["reset"] is True
    third = report(result, 2)
    assert (third["hit_tokens"], third["vllm_cached_tokens"], third["external_tokens"]) == (256, 0, 256)
    assert third["totals"]["hit_tokens"] == third["totals"]["loaded_tokens"] == 256
    assert "in the background" in result["log"]  # the disk tier is not memory: the load is asynchronous
