"""The KV oracle on SGLang's real MHATokenToKVPool: a load writes exactly the KV that was stored,
bit for bit (int8: within its bound), over page sizes, chunk sizes (one that is not a power of
two), KV head counts (MQA's one), serializers, tiers and connectors; mutations are caught."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_pools import clear_pool, fill_random, kvplug_extra, make_pool, write_model_dir

from kvplug.testing import KVSlots, LossyBound, assert_kv_matches, compare_kv
from kvplug_sglang.connector import KVPlugConnector, LoadMetadata, StoreMetadata
from kvplug_sglang.kv_capture import capture_pool_slots

TOKENS = list(range(500, 700))  # 200 tokens


@dataclass(frozen=True)
class Cell:
    page_size: int = 1
    chunk_size: int = 16
    heads: int = 2
    serializer: str = "raw"
    tier: str = "cpu"
    connector: str = "torch"

    @property
    def id(self) -> str:
        return f"page{self.page_size}/chunk{self.chunk_size}/heads{self.heads}/{self.serializer}/{self.tier}/{self.connector}"


CELLS = [
    Cell(),
    Cell(page_size=16, chunk_size=48, serializer="zstd", tier="disk", connector="native"),
    Cell(chunk_size=64, heads=1, serializer="lz4", connector="native"),
    Cell(page_size=16, chunk_size=32, heads=1, serializer="int8", tier="disk"),
    Cell(page_size=16, chunk_size=16, serializer="fp8", connector="native"),
]


def connector_for(cell: Cell, tmp_path: Path) -> tuple[Any, KVPlugConnector]:
    from sglang.srt.configs.model_config import ModelConfig

    model = ModelConfig(str(write_model_dir(tmp_path / f"model-{cell.heads}", num_kv_heads=cell.heads)))
    pool = make_pool(size=512, page_size=cell.page_size, heads=cell.heads)
    tier: dict[str, Any] = {"type": cell.tier}
    if cell.tier == "disk":
        tier.update(path=str(tmp_path / "kv"), queue={"mode": "sync"})
    extra = kvplug_extra(
        [tier], chunk_size=cell.chunk_size, serializer={"type": cell.serializer}, connector={"type": cell.connector}
    )
    return pool, KVPlugConnector(model, 1, 0, pool.k_buffer, pool.v_buffer, engine_extra=extra)


def store_then_load(cell: Cell, tmp_path: Path, seed: int) -> tuple[Any, KVSlots, torch.Tensor, int]:
    """Random KV at slots 1.., stored under ``cell``, the pool cleared, loaded into slots 256..;
    returns the pool, the stored slots' capture, the load's slots and the tokens loaded."""
    pool, connector = connector_for(cell, tmp_path)
    source = torch.arange(1, len(TOKENS) + 1)
    fill_random(pool, source, seed=seed)
    stored = capture_pool_slots(pool, source)
    connector.store_kv(StoreMetadata(last_node=None, token_ids=TOKENS, kv_indices=source, offset=0))
    clear_pool(pool)
    target = torch.arange(256, 256 + len(TOKENS))
    loaded = connector.load_kv(LoadMetadata(token_ids=TOKENS, slot_mapping=target, offset=0))
    connector.close()
    return pool, stored, target, loaded


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.id)
def test_a_load_is_the_kv_that_was_stored(cell: Cell, tmp_path: Path) -> None:
    pool, stored, target, loaded = store_then_load(cell, tmp_path, seed=3)
    assert loaded == len(TOKENS) // cell.chunk_size * cell.chunk_size
    bound = LossyBound(cell.serializer) if cell.serializer in ("int8", "fp8") else None  # type: ignore[arg-type]
    assert_kv_matches([capture_pool_slots(pool, target)], [stored], loaded, bound=bound)


def test_the_oracle_catches_a_wrong_load_on_a_pool(tmp_path: Path) -> None:
    pool, stored, target, hit = store_then_load(Cell(chunk_size=32), tmp_path, seed=4)
    loaded = capture_pool_slots(pool, target)
    assert compare_kv([loaded], [stored], hit).equal
    shifted = capture_pool_slots(pool, torch.cat([target[:32], target[31:-1]]))  # a token late from 32 on
    heads = replace(loaded, layers=[t.flip(2) for t in loaded.layers])
    found = compare_kv([shifted], [stored], hit).mismatches
    assert found and all(m.tokens[0] >= 32 for m in found)
    assert {(m.layer, m.heads) for m in compare_kv([heads], [stored], hit).mismatches} >= {(0, (0, 2))}
