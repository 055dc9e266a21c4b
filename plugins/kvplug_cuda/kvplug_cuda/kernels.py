"""Triton kernels: paged cache <-> contiguous chunk, all layers of a chunk per launch.

One kernel, :func:`_paged_copy_kernel`, serves gather and scatter for every layout
(see :mod:`kvplug_cuda.addressing`). A program copies one token row (all heads) of
one (layer, K|V) pair, in tiles of machine words. The chunk side is always a
contiguous ``[num_layers * num_kv, num_tokens, row_words]`` word buffer.

The connector rejects slots outside ``[0, num_slots)`` before launching; the
kernel also masks them (a skipped row, zeros in a gathered chunk), so a slot
mapping can never make it touch memory outside the cache.

Under ``TRITON_INTERPRET=1`` (read when this module is imported) the same kernel
runs on CPU tensors in Triton's interpreter; the tests use that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvplug_cuda.addressing import PagedAddressing

#: Most words one program copies per tile; wider rows take more tiles (grid axis 2).
MAX_TILE_WORDS = 1024


@triton.jit  # type: ignore[untyped-decorator]  # Triton has no type information
def _paged_copy_kernel(  # type: ignore[no-untyped-def]  # arguments are Triton pointers and constexprs
    cache_ptr,
    table_ptr,
    slot_ptr,
    chunk_ptr,
    num_tokens,
    num_slots,
    stride_block,
    stride_offset,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_WORDS: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    HEADS_PACKED: tl.constexpr,
    TILE: tl.constexpr,
    TO_CHUNK: tl.constexpr,
):
    token = tl.program_id(0)
    pair = tl.program_id(1)  # layer * num_kv + kv
    tile = tl.program_id(2)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    bad = (slot < 0) | (slot >= num_slots)
    slot = tl.where(bad, 0, slot)
    row = tl.load(table_ptr + pair) + (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_offset
    words = tile * TILE + tl.arange(0, TILE)
    in_row = words < ROW_WORDS
    live = words < tl.where(bad, 0, ROW_WORDS)  # in_row, and nothing for a bad slot
    if HEADS_PACKED:
        cache_offsets = row + words
    else:
        cache_offsets = row + (words // HEAD_WORDS).to(tl.int64) * stride_head + words % HEAD_WORDS
    chunk_offsets = (pair.to(tl.int64) * num_tokens + token) * ROW_WORDS + words
    if TO_CHUNK:
        values = tl.load(cache_ptr + cache_offsets, mask=live, other=0)
        tl.store(chunk_ptr + chunk_offsets, values, mask=in_row)
    else:
        values = tl.load(chunk_ptr + chunk_offsets, mask=in_row)
        tl.store(cache_ptr + cache_offsets, values, mask=live)


def paged_copy(
    addressing: PagedAddressing,
    base: torch.Tensor,
    slots: torch.Tensor,
    chunk: torch.Tensor,
    *,
    to_chunk: bool,
) -> None:
    """Copy every (layer, K|V) row of ``slots`` between the cache at ``base`` and ``chunk``.

    ``base`` is a word view at layer 0's origin (:func:`addressing.base_tensor`),
    ``slots`` an int64 tensor, ``chunk`` a contiguous word tensor of
    ``num_layers * num_kv * len(slots) * row_words`` words.
    Launches on the current stream and returns at once.
    """
    launch = kernel_launch(addressing, base, slots, chunk, to_chunk=to_chunk)
    if launch is not None:
        _paged_copy_kernel[launch.grid](*launch.arguments, **launch.constants, **launch.options)


@dataclass(frozen=True)
class KernelLaunch:
    """Everything one launch of :func:`_paged_copy_kernel` is given."""

    grid: tuple[int, int, int]
    arguments: tuple[Any, ...]  # runtime arguments, in the kernel's order
    constants: dict[str, Any]  # compile-time (tl.constexpr) arguments
    options: dict[str, Any]  # compiler options


def kernel_launch(
    addressing: PagedAddressing,
    base: torch.Tensor,
    slots: torch.Tensor,
    chunk: torch.Tensor,
    *,
    to_chunk: bool,
) -> KernelLaunch | None:
    """The launch :func:`paged_copy` makes (None: nothing to copy); raises on a mis-sized ``chunk``.

    Kept apart from the launch itself so the tests can compile exactly these
    specialisations for real GPU targets on a machine without one.
    """
    num_tokens = slots.numel()
    pairs = addressing.table.numel()
    if num_tokens == 0 or pairs == 0:
        return None
    if chunk.dtype != addressing.word or chunk.numel() != pairs * num_tokens * addressing.row_words:
        raise ValueError(
            f"chunk buffer is {chunk.dtype} x {chunk.numel()}, need {addressing.word} x "
            f"{pairs * num_tokens * addressing.row_words}"
        )
    tile = min(triton.next_power_of_2(addressing.row_words), MAX_TILE_WORDS)
    return KernelLaunch(
        grid=(num_tokens, pairs, triton.cdiv(addressing.row_words, tile)),
        arguments=(
            base,
            addressing.table,
            slots,
            chunk,
            num_tokens,
            addressing.num_slots,
            addressing.stride_block,
            addressing.stride_offset,
            addressing.stride_head,
        ),
        constants={
            "BLOCK_SIZE": addressing.block_size,
            "HEAD_WORDS": addressing.head_words,
            "ROW_WORDS": addressing.row_words,
            "HEADS_PACKED": addressing.heads_packed,
            "TILE": tile,
            "TO_CHUNK": to_chunk,
        },
        # No float arithmetic to fuse; saying so also keeps Triton 3.9's default-change warning quiet.
        options={"num_warps": 4 if tile >= 256 else 1, "enable_fp_fusion": False},
    )


def interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(_paged_copy_kernel).__name__ == "InterpretedFunction"
