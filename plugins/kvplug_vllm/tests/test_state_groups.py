"""Recurrent-state groups (state_groups.py) without an engine: the page views over vLLM's
state tensors, and which block each chunk of a store or load maps to. The engine test is
test_hybrid.py's Gated DeltaNet test."""

from __future__ import annotations

import pytest
import torch

from kvplug.errors import LayoutError
from kvplug_vllm.kv_groups import NULL_BLOCK_ID
from kvplug_vllm.state_groups import state_layout, state_load_block_ids, state_pages, state_store_calls

PAGE = 4096
BLOCKS = 6
CHUNK = 64


def vllm_state_tensors(raw: torch.Tensor) -> list[torch.Tensor]:
    """Two state tensors (conv, ssm) in one raw buffer, one padded page per block, as vLLM
    lays them out (as_strided views with a page stride)."""
    conv = torch.as_strided(raw.view(torch.bfloat16), (BLOCKS, 3, 64), (PAGE // 2, 64, 1), 0)
    ssm = torch.as_strided(raw.view(torch.bfloat16), (BLOCKS, 2, 16, 16), (PAGE // 2, 256, 16, 1), 3 * 64)
    return [conv, ssm]


def test_pages_view_each_blocks_page_as_one_chunk_of_bytes() -> None:
    raw = torch.zeros(BLOCKS * PAGE, dtype=torch.uint8)
    conv, ssm = vllm_state_tensors(raw)
    conv[4].fill_(1.5)
    ssm[4].fill_(-2.0)
    (pages,) = state_pages([[conv, ssm]], ["layers.0.linear_attn"], CHUNK)
    assert pages.shape == (BLOCKS, CHUNK, PAGE // CHUNK) and pages.dtype == torch.uint8
    assert torch.equal(pages[4].flatten(), raw[4 * PAGE : 5 * PAGE])
    # a page written through the view is the state vLLM reads
    pages[2].copy_(pages[4])
    assert torch.equal(conv[2], conv[4]) and torch.equal(ssm[2], ssm[4])
    layout = state_layout([pages], CHUNK)
    assert layout.block_size == CHUNK and layout.head_dim == PAGE // CHUNK and layout.dtype == torch.uint8


def test_a_page_that_is_no_whole_number_of_bytes_per_token_is_refused() -> None:
    raw = torch.zeros(BLOCKS * PAGE, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="use a chunk_size that divides 4096"):
        state_pages([vllm_state_tensors(raw)], ["layers.0.linear_attn"], 384)


def test_tensors_that_are_not_one_page_per_block_are_refused() -> None:
    conv = torch.zeros(BLOCKS, 3, 64, dtype=torch.bfloat16)
    ssm = torch.zeros(BLOCKS, 2, 16, 16, dtype=torch.bfloat16)  # another buffer
    with pytest.raises(LayoutError, match="not one page per block in one buffer"):
        state_pages([[conv, ssm]], ["layers.0.linear_attn"], CHUNK)


def test_a_load_writes_only_the_state_at_the_hit_boundary() -> None:
    # vLLM's align table: null blocks before the state the request resumes from
    assert state_load_block_ids([0, 0, 0, 0, 0, 31, 32], 768, 384, 128) == [NULL_BLOCK_ID, 31]
    assert state_load_block_ids([0, 9], 256, 128, 128) == [NULL_BLOCK_ID, 9]
    # no block there: the load fails (vLLM recomputes), it never skips the state
    for table, hit in (([0, 9], 384), ([0, 0], 256), ([0, 9], 0), ([0, 9, 10], 320)):
        with pytest.raises(LayoutError):
            state_load_block_ids(table, hit, 128, 128)


def test_a_store_writes_each_handed_state_as_the_chunk_ending_at_its_boundary() -> None:
    handed = [(768, 41), (384, 40), (1000, 42), (768, 41), (1152, NULL_BLOCK_ID), (1536, 43)]
    # 1000 is no chunk end, the null block holds nothing, 1536 is past the tokens known
    assert state_store_calls(handed, 1200, 384) == [(384, [40]), (768, [NULL_BLOCK_ID, 41])]
