"""The KV oracle's other cells (see test_kv_oracle.py): lossy serializers, a hybrid model with
sliding-window layers and attention sinks, and a load across TP sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
from oracle_cells import FULL, FULL_CELLS, Cell, References, run_cell

pytestmark = pytest.mark.timeout(1800)

CELLS = FULL_CELLS[1::2] if FULL else [
    Cell("llama-gqa", chunk_size=256, serializer="int8", tier="disk", connector="torch", load="async"),
    Cell("llama-gqa", chunk_size=64, serializer="fp8", connector="native"),
    Cell("gpt-oss", chunk_size=64, tier="disk"),
    Cell("llama-gqa", chunk_size=544, tier="shm", serializer="lz4", writer_tp=2, reader_tp=1, load="async"),
    Cell("gpt-oss", chunk_size=256, tier="disk", load="async", block_granular_hits=True),
]  # fmt: skip


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.id)
def test_a_load_is_the_kv_the_engine_computed(cell: Cell, oracle_references: References, tmp_path: Path) -> None:
    run_cell(cell, oracle_references, tmp_path)
