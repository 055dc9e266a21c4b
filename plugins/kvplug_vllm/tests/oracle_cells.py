"""The KV oracle's matrix: one cell is one kvplug configuration on one model, checked on real engines.

A cell stores a prompt and loads it back (one engine, two steps; two engines when the
writer's TP size differs from the reader's) and compares every slot the load wrote with
the KV a no-connector engine of the writer's TP size computed for the same tokens
(:func:`kvplug.testing.assert_kv_matches`): bit for bit, or within a lossy serializer's
bound. Each model's reference is captured once per test module (:class:`References`, the
``oracle_references`` fixture of conftest.py).

``ORACLE_MATRIX=full`` (``nox -s oracle``) runs every cell of :data:`FULL_CELLS` (15); the vllm
session runs the cells of each test module.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conftest import kv_config, tokens
from oracle_support import captured_run, loaded_tokens

from kvplug.testing import KVComparison, KVSlots, LossyBound, assert_kv_matches
from kvplug_vllm.tiny_model import (
    TinyGptOssSpec,
    TinyLlamaSpec,
    TinyQwen3NextSpec,
    write_random_gpt_oss,
    write_random_llama,
    write_random_qwen3_next,
)

#: 600 tokens: hits of 576 (chunks of 32 and 64), 512 (256), 544 (544: not a power of two); 576
#: with block_granular_hits (the tail to the last block end).
PROMPT = tokens(60, 600)
ENGINE_OPTIONS = {"max_model_len": 1024, "num_blocks": 96}
#: The engines' block size (engine_driver.py's default): a tail ends at a multiple of it.
BLOCK_SIZE = 32
FULL = os.environ.get("ORACLE_MATRIX") == "full"

MODELS: dict[str, Callable[[Path], Path]] = {
    "llama-gqa": lambda p: write_random_llama(p, TinyLlamaSpec(num_key_value_heads=2, initializer_range=0.1)),
    "llama-gqa4": lambda p: write_random_llama(p, TinyLlamaSpec(num_key_value_heads=4, initializer_range=0.1)),
    "llama-mqa": lambda p: write_random_llama(p, TinyLlamaSpec(num_key_value_heads=1, initializer_range=0.1)),
    # sliding-window layers with attention sinks and full layers: two KV cache groups
    "gpt-oss": lambda p: write_random_gpt_oss(p, TinyGptOssSpec()),
    "gemma3-style": lambda p: write_random_llama(
        p, TinyLlamaSpec(layer_types=("sliding_attention", "full_attention"), sliding_window=128, seed=3)
    ),
    # Gated DeltaNet + full attention in vLLM's align mode: the attention group is compared (the
    # recurrent state is one per request, not captured: test_hybrid.py checks it by the output)
    "qwen3-next": lambda p: write_random_qwen3_next(p, TinyQwen3NextSpec(a_log=-8.0)),
}
#: Engine options a model needs: align mode wants prefix caching and picks its block size (384 here).
MODEL_OPTIONS: dict[str, dict[str, Any]] = {
    "qwen3-next": {"block_size": None, "prefix_caching": True, "mamba_cache_mode": "align", "max_model_len": 2048},
}


@dataclass(frozen=True)
class Cell:
    """One kvplug configuration on one model."""

    model: str
    chunk_size: int = 64
    heads_per_record: int | str = "auto"
    serializer: str = "raw"
    tier: str = "cpu"
    connector: str = "auto"
    load: str = "sync"
    layerwise: bool = False
    writer_tp: int = 1
    reader_tp: int = 1
    #: Tails in whole blocks too (``block_granular_hits``): the hit ends at a block end past the
    #: last whole chunk, inside a chunk.
    block_granular_hits: bool = False

    @property
    def id(self) -> str:
        chunks = f"chunk{self.chunk_size}" + ("-blocks" if self.block_granular_hits else "")
        parts = [self.model, chunks, f"hpr-{self.heads_per_record}", self.serializer, self.tier]
        parts += [
            self.connector,
            self.load + ("-layerwise" if self.layerwise else ""),
            f"tp{self.writer_tp}to{self.reader_tp}",
        ]
        return "/".join(parts)

    @property
    def bound(self) -> LossyBound | None:
        return LossyBound(self.serializer) if self.serializer in ("int8", "fp8") else None  # type: ignore[arg-type]

    def kv(self, folder: Path) -> dict[str, Any]:
        tier: dict[str, Any] = {"type": self.tier, "queue": {"mode": "sync"}}
        if self.tier == "disk":
            tier["path"] = str(folder / "kv")
        elif self.tier == "shm":
            tier["path"] = f"/dev/shm/kvplug-oracle-{os.getpid()}-{folder.name}"
        extra: dict[str, Any] = {
            "kvplug.chunk_size": self.chunk_size,
            "kvplug.serializer": {"type": self.serializer},
            "kvplug.connector": {"type": self.connector},
            "kvplug.tiers": [tier],
            "kvplug.store.queue.mode": "sync",  # stored when the step ends: the next step hits
            "kvplug.load": self.load,
            "kvplug.layerwise": self.layerwise,
            "kvplug.block_granular_hits": self.block_granular_hits,
        }
        if self.heads_per_record != "auto":
            extra["kvplug.heads_per_record"] = self.heads_per_record
        return kv_config(**extra)


class References:
    """Each model's no-connector capture of :data:`PROMPT`, per TP size, made once."""

    def __init__(self, run_engine: Any, folder: Path) -> None:
        self.run_engine = run_engine
        self.folder = folder
        self.models: dict[str, str] = {}
        self.captures: dict[tuple[str, int], list[KVSlots]] = {}

    def model(self, name: str) -> str:
        if name not in self.models:
            self.models[name] = str(MODELS[name](self.folder / name))
        return self.models[name]

    def of(self, name: str, tp: int) -> list[KVSlots]:
        if (name, tp) not in self.captures:
            _, (capture,) = captured_run(
                self.run_engine, self.folder, kv=None, prompts=[PROMPT], model=self.model(name),
                tensor_parallel_size=tp, **{**ENGINE_OPTIONS, **MODEL_OPTIONS.get(name, {})},
            )  # fmt: skip
            self.captures[(name, tp)] = capture
        return self.captures[(name, tp)]


def run_cell(cell: Cell, references: References, folder: Path) -> tuple[int, list[KVSlots], KVComparison]:
    """Store :data:`PROMPT` under ``cell``, load it back, and check the load with the oracle;
    returns the hit, the load's capture and the comparison."""
    folder.mkdir(parents=True, exist_ok=True)
    kv = cell.kv(folder)
    model = references.model(cell.model)
    options = {"model": model, **ENGINE_OPTIONS, **MODEL_OPTIONS.get(cell.model, {})}
    # With vLLM's prefix cache on, the same engine's second request would hit it, not kvplug: a new process reads.
    if cell.writer_tp == cell.reader_tp and not options.get("prefix_caching"):
        result, (_, loaded) = captured_run(
            references.run_engine,
            folder,
            kv=kv,
            prompts=[PROMPT, PROMPT],
            tensor_parallel_size=cell.reader_tp,
            **options,
        )
        index = 1
    else:
        captured_run(
            references.run_engine, folder, kv=kv, prompts=[PROMPT], tensor_parallel_size=cell.writer_tp, **options
        )
        result, (loaded,) = captured_run(
            references.run_engine, folder, kv=kv, prompts=[PROMPT], tensor_parallel_size=cell.reader_tp, **options
        )
        index = 0
    hit = loaded_tokens(result, index)
    whole = len(PROMPT) // cell.chunk_size * cell.chunk_size
    expected = max(whole, len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE) if cell.block_granular_hits else whole
    assert hit == expected, f"{cell.id}: hit {hit}"
    reference = references.of(cell.model, cell.writer_tp)
    return hit, loaded, assert_kv_matches(loaded, reference, hit, bound=cell.bound)


#: The whole matrix (``nox -s oracle``): every family, chunk size, heads_per_record, serializer,
#: tier, connector and load mode at least once, TP sizes 1 and 2 in both directions.
FULL_CELLS = [
    Cell("llama-gqa", chunk_size=32, connector="torch"),
    Cell(
        "llama-gqa",
        chunk_size=544,
        heads_per_record=1,
        serializer="zstd",
        tier="disk",
        connector="native",
        load="async",
    ),
    Cell("llama-mqa", chunk_size=64, serializer="lz4", tier="shm", connector="native", layerwise=True),
    Cell("llama-gqa", chunk_size=256, serializer="int8", tier="disk", connector="torch", load="async"),
    Cell("llama-gqa", chunk_size=64, serializer="fp8", connector="native"),
    Cell("gpt-oss", chunk_size=64, tier="disk"),
    Cell("gemma3-style", chunk_size=128, serializer="zstd", tier="shm", connector="torch"),
    Cell("llama-gqa4", chunk_size=64, heads_per_record=2, tier="disk", writer_tp=1, reader_tp=2),
    Cell("llama-gqa4", chunk_size=256, tier="disk", connector="torch", writer_tp=2, reader_tp=1),
    Cell("llama-gqa", chunk_size=544, tier="shm", serializer="lz4", writer_tp=2, reader_tp=1, load="async"),
    Cell("llama-gqa", chunk_size=32, heads_per_record=1, tier="disk", serializer="int8", writer_tp=1, reader_tp=2),
    Cell("llama-gqa4", chunk_size=64, heads_per_record=1, tier="shm", writer_tp=2, reader_tp=2, layerwise=True),
    Cell("llama-mqa", chunk_size=256, tier="disk", serializer="fp8", connector="torch", writer_tp=2, reader_tp=1),
    Cell("gpt-oss", chunk_size=256, tier="shm", serializer="zstd", connector="native", load="async"),
    Cell("qwen3-next", chunk_size=384, tier="disk"),
    Cell("llama-gqa", chunk_size=256, block_granular_hits=True),
    Cell("gpt-oss", chunk_size=256, tier="disk", load="async", block_granular_hits=True),
]
