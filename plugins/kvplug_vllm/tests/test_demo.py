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
    assert (result["cold_hit_tokens"], result["warm_hit_tokens"], result["loaded_tokens"]) == (0, 1024, 1023)
    text = console.file.getvalue()
    assert "outputs identical" in text and "TTFT warm" in text
