"""A vLLM LoRA adapter is keyed by its files, not its path: an RL or fine-tuning loop that
rewrites its adapter at the same path and reloads it (unload + load, or ``load_inplace``)
never loads the old adapter's chunks, and servers with the same files at other paths share."""

from __future__ import annotations

import shutil
from pathlib import Path

from test_tier_media import (  # noqa: F401  (engine_and_control, engine, registry: fixtures)
    PROMPT,
    engine,
    engine_and_control,
    registry,
)
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.v1.request import Request

from kvplug import CacheEngine
from kvplug.testing import write_lora_adapter
from kvplug_vllm.request_state import request_info

__all__ = ["engine", "registry"]  # fixtures


def keys(engine: CacheEngine, lora: LoRARequest) -> list[str]:
    request = Request("r", PROMPT, SamplingParams(max_tokens=1), None, lora_request=lora)
    return [k.key for k in engine.chunk_keys(PROMPT, request_info(request, engine.config))]


def test_an_adapter_rewritten_at_its_path_and_reloaded_shares_no_chunk_with_the_old_one(
    engine: CacheEngine, tmp_path: Path
) -> None:
    adapter = write_lora_adapter(tmp_path / "sql", b"weights of step 1")
    before = keys(engine, LoRARequest("sql", 1, str(adapter)))
    assert keys(engine, LoRARequest("sql", 1, str(adapter))) == before

    write_lora_adapter(adapter, b"weights of step 2")  # the trainer's next checkpoint, same path
    after = keys(engine, LoRARequest("sql", 2, str(adapter), load_inplace=True))
    assert not set(before) & set(after), "the rewritten adapter was keyed as the old one: its KV would hit"


def test_the_same_adapter_files_at_another_path_share_chunks(engine: CacheEngine, tmp_path: Path) -> None:
    adapter = write_lora_adapter(tmp_path / "server-1" / "sql", b"weights")
    copy = shutil.copytree(adapter, tmp_path / "server-2" / "sql-v7")
    assert keys(engine, LoRARequest("sql", 1, str(adapter))) == keys(engine, LoRARequest("sql", 3, str(copy)))
