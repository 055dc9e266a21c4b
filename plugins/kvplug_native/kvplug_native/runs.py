"""Run tables: the byte runs that move a batch of chunks between a paged cache and chunk tensors.

A copy between a paged KV cache and chunk tensors is a list of contiguous runs of
bytes. This module finds them for a whole engine call at once, with a few vectorized
torch ops whatever the number of chunks and layers:

1. *units*: the smallest pieces that are contiguous on both sides, per K/V index. A
   token's row of heads (``num_kv_heads * head_dim`` elements) where the cache keeps
   a token's heads together, a head's row where it does not, and for packed
   (``whole_blocks_only``) formats a block's ``inner`` run
   (:meth:`kvplug.KVLayout.packed_block_split`);
2. *runs*: units that continue each other on both sides merged into one run (a whole
   block, or consecutive blocks of a prompt), never across two chunks;
3. *table*: every layer's runs turned into absolute addresses, ``[rows, 3]`` int64:
   destination, source, bytes (:func:`run_table`).

Steps 1 and 2 depend only on the slots and the cache's shape and strides, so they run
once per engine call and geometry; step 3 runs per batch of layers. Every address is
derived from a tensor's own shape and strides and from slots checked against them,
so the C copy can trust the table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

from kvplug import KVLayout, LazyModule
from kvplug.errors import LayoutError

if TYPE_CHECKING:
    import torch
else:  # imported on first use: ``kvplug plugins`` and ``config validate`` load this module without torch
    torch = LazyModule("torch")

#: Columns of a run table: destination address, source address, bytes.
DST, SRC, NBYTES = 0, 1, 2


@dataclass(frozen=True)
class Runs:
    """The runs of one K/V index for a call's chunks, relative to their bases.

    ``source`` is in bytes from the start of the layer tensor that holds this K/V
    index; ``target`` in bytes from the start of the chunk's ``[num_tokens, width]``
    rows of this K/V index.
    """

    kv_index: int
    tensor: int  # which of the layer's tensors (format.tensors) holds this K/V index
    chunk: torch.Tensor  # [R] the span (chunk) each run belongs to
    source: torch.Tensor  # [R]
    target: torch.Tensor  # [R]
    nbytes: torch.Tensor  # [R]


def layer_geometry(tensors: Sequence[torch.Tensor]) -> tuple[object, ...]:
    """What the runs of a layer depend on: its tensors' shapes, strides, dtype and device."""
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in tensors)


def find_runs(
    layout: KVLayout,
    tensors: Sequence[torch.Tensor],
    slots: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    blocks: Sequence[torch.Tensor | None],
) -> list[Runs] | None:
    """The runs of every K/V index for ``slots[start:end]`` of each span, or None where runs do not apply.

    ``blocks[k]`` holds the blocks span ``k`` fills when it fills whole blocks in order
    (packed formats copy nothing else). None is returned for caches a run table cannot
    address (a ``head_dim`` axis that is not contiguous); the caller copies those with
    torch. A slot or block outside the cache raises :class:`kvplug.errors.LayoutError`.
    """
    itemsize = tensors[0].element_size()
    if layout.whole_blocks_only:
        return _packed_runs(layout, tensors, spans, blocks, itemsize)
    views = layout.kv_views(tuple(tensors) if len(tensors) > 1 else tensors[0])
    per_tensor = len(views) // len(tensors)
    if any(view.stride(3) != 1 and view.shape[3] > 1 for view in views):
        return None
    page_tokens = views[0].shape[1]
    pages = min(view.shape[0] for view in views)  # K and V may be tensors of different sizes
    position, chunk = _positions(spans, slots.device)
    slot = slots[position]
    if slot.numel():
        low, high = torch.stack(torch.aminmax(slot)).tolist()
        if low < 0 or high >= pages * page_tokens:
            raise LayoutError(
                f"slot {low if low < 0 else high} is outside the cache: it holds {pages * page_tokens} slots "
                f"({pages} pages of {page_tokens})"
            )
    page = torch.div(slot, page_tokens, rounding_mode="floor")
    token = slot - page * page_tokens
    chunk_token = position - _span_starts(spans, slots.device)[chunk]
    found: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}
    runs = []
    for index, view in enumerate(views):
        tensor = index // per_tensor
        origin = view.data_ptr() - tensors[tensor].data_ptr()
        _, _, heads, dim = view.shape
        page_stride, token_stride, head_stride, _ = view.stride()
        key = (page_stride, token_stride, head_stride)
        if key not in found:  # K and V of a layer share their strides: their runs differ by an offset
            found[key] = _token_runs(
                page * page_stride + token * token_stride, chunk_token, chunk, heads, dim, head_stride, itemsize
            )
        run_chunk, source, target, nbytes = found[key]
        runs.append(Runs(index, tensor, run_chunk, source + origin, target, nbytes))
    return runs


def _token_runs(
    row_start: torch.Tensor,
    chunk_token: torch.Tensor,
    chunk: torch.Tensor,
    heads: int,
    dim: int,
    head_stride: int,
    itemsize: int,
) -> tuple[torch.Tensor, ...]:
    """Runs of one K/V index: a token's heads as one unit where they are contiguous, else a unit per head."""
    width = heads * dim
    if heads == 1 or head_stride == dim:
        return _merge(chunk, row_start * itemsize, chunk_token * (width * itemsize), width * itemsize)
    head = torch.arange(heads, device=row_start.device)
    source = (row_start[:, None] + head * head_stride).flatten()
    target = (chunk_token[:, None] * width + head * dim).flatten()
    return _merge(chunk.repeat_interleave(heads), source * itemsize, target * itemsize, dim * itemsize)


def _packed_runs(
    layout: KVLayout,
    tensors: Sequence[torch.Tensor],
    spans: Sequence[tuple[int, int]],
    blocks: Sequence[torch.Tensor | None],
    itemsize: int,
) -> list[Runs]:
    """Runs of a packed format: each block's ``inner`` runs, as the chunk holds them (split by K/V index only)."""
    outer, kv, inner = layout.packed_block_split()
    picked = []
    for (start, end), span_blocks in zip(spans, blocks):
        if span_blocks is None:
            raise LayoutError(
                f"layout {layout.format.name} packs tokens inside a block engine-privately, so only whole "
                f"blocks of {layout.block_size} tokens can be copied; got {end - start} slots that do not fill "
                "whole blocks in order"
            )
        picked.append(span_blocks)
    device = tensors[0].device
    block = torch.cat(picked) if picked else torch.empty(0, dtype=torch.long, device=device)
    chunk = torch.repeat_interleave(
        torch.arange(len(picked), device=device), torch.tensor([b.numel() for b in picked], device=device)
    )
    block_in_chunk = torch.arange(block.numel(), device=device) - _cumulative_starts(picked, device)[chunk]
    runs = []
    for tensor_index, tensor in enumerate(tensors):
        rows = tensor.shape[0]
        if block.numel():
            low, high = torch.stack(torch.aminmax(block)).tolist()
            if low < 0 or high >= rows:
                raise LayoutError(f"block {low if low < 0 else high} is outside the cache: it holds {rows} blocks")
        block_elements = math.prod(tensor.shape[1:])
        if (rows and not tensor[0].is_contiguous()) or outer * kv * inner != block_elements:
            raise LayoutError(
                f"layout {layout.format.name}: a block of the cache tensor {tuple(tensor.shape)} with strides "
                f"{tensor.stride()} is not one run of memory; whole-block copies need dense blocks"
            )
        o = torch.arange(outer, device=device)
        for j in range(kv):
            source = (block[:, None] * tensor.stride(0) + (o * kv + j) * inner).flatten()
            target = ((block_in_chunk[:, None] * outer + o) * inner).flatten()
            merged = _merge(chunk.repeat_interleave(outer), source * itemsize, target * itemsize, inner * itemsize)
            runs.append(Runs(tensor_index * kv + j, tensor_index, *merged))
    return runs


def _merge(chunk: torch.Tensor, source: torch.Tensor, target: torch.Tensor, unit: int) -> tuple[torch.Tensor, ...]:
    """Units of ``unit`` bytes that continue each other on both sides (same chunk) as one run each."""
    count = source.numel()
    if count == 0:
        empty = source.new_empty(0)
        return empty, empty, empty, empty
    starts = torch.ones(count, dtype=torch.bool, device=source.device)
    starts[1:] = (chunk[1:] != chunk[:-1]) | (source[1:] != source[:-1] + unit) | (target[1:] != target[:-1] + unit)
    first = torch.nonzero(starts).flatten()
    ends = torch.cat([first[1:], first.new_tensor([count])])
    return chunk[first], source[first], target[first], (ends - first) * unit


def run_table(
    runs: Sequence[Runs],
    layer_bases: torch.Tensor,
    layers: Sequence[int],
    chunk_bases: torch.Tensor,
    chunk_strides: torch.Tensor,
    *,
    into_cache: bool,
) -> torch.Tensor:
    """The ``[rows, 3]`` table (destination, source, bytes) for ``layers`` of every chunk.

    ``layer_bases[l, t]``: address of tensor ``t`` of layer ``l``; ``chunk_bases[c]``:
    address of chunk ``c``'s tensor ``[num_layers, num_kv, n, width]``;
    ``chunk_strides[c]``: its layer and K/V strides in bytes. ``into_cache`` swaps the
    columns: the cache is the destination.
    """
    layer = torch.as_tensor(list(layers), dtype=torch.long)
    parts = []
    for run in runs:
        base = chunk_bases[run.chunk] + run.kv_index * chunk_strides[run.chunk, 1] + run.target
        chunk_side = base[None, :] + layer[:, None] * chunk_strides[run.chunk, 0][None, :]
        cache_side = layer_bases[layer, run.tensor][:, None] + run.source[None, :]
        nbytes = run.nbytes.expand(layer.numel(), -1)
        columns = (cache_side, chunk_side) if into_cache else (chunk_side, cache_side)
        parts.append(torch.stack((*columns, nbytes), dim=-1).reshape(-1, 3))
    if not parts:
        return torch.empty(0, 3, dtype=torch.long)
    return torch.cat(parts).contiguous()


def split_table(table: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``table`` in at most ``parts`` consecutive shares of about the same bytes (whole rows each)."""
    rows = table.shape[0]
    if parts <= 1 or rows <= 1:
        return [table] if rows else []
    ends = torch.cumsum(table[:, NBYTES], 0)
    total = int(ends[-1])
    marks = torch.tensor([total * k // parts for k in range(1, parts)], dtype=ends.dtype)
    cuts = [0, *torch.searchsorted(ends, marks, right=True).tolist(), rows]
    return [table[a:b] for a, b in pairwise(cuts) if b > a]


def _positions(spans: Sequence[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in the slot tensor of every span's slots, in span order, and the span of each."""
    lengths = torch.tensor([end - start for start, end in spans], dtype=torch.long, device=device)
    chunk = torch.repeat_interleave(torch.arange(len(spans), device=device), lengths)
    starts = _span_starts(spans, device)
    offsets = torch.arange(chunk.numel(), device=device) - (torch.cumsum(lengths, 0) - lengths)[chunk]
    return starts[chunk] + offsets, chunk


def _span_starts(spans: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    return torch.tensor([start for start, _ in spans], dtype=torch.long, device=device)


def _cumulative_starts(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.long, device=device)
    return torch.cumsum(lengths, 0) - lengths
