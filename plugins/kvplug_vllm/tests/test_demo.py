"""``kvplug demo`` with kvplug-vllm installed runs a real vLLM engine."""

from __future__ import annotations

import io

from rich.console import Console

import kvplug


def test_vllm_adapter_demo_runs_the_real_engine() -> None:
    adapter = kvplug.get_registry().engine_adapters()["vllm"]
    console = Console(file=io.StringIO(), width=120)
    result = adapter.run_demo(console, tokens=1024)
    assert result["identical"]
    assert result["distinct_output_tokens"] >= 4  # not a model that repeats one token
    assert (result["cold_hit_tokens"], result["warm_hit_tokens"], result["loaded_tokens"]) == (0, 1024, 1023)
    assert result["warm_requests"] == 5
    assert result["ttft_warm_min_s"] <= result["ttft_warm_s"] <= result["ttft_warm_max_s"]
    text = console.file.getvalue()
    assert "outputs identical" in text and "TTFT warm (loaded), median of 5" in text
    assert "machine load (1 min) / CPUs" in text
