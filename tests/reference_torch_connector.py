"""The torch connector's gather/scatter as of kvplug 0.1, when layouts were a closed list of kinds.

A verbatim copy of ``kvplug/builtins/torch_connector.py`` before engine formats
became :class:`kvplug.PagedFormat` declarations (only the class name changed, and
``layout.kind`` is read as ``layout.format.name``). test_paged_formats.py checks
that the generic connector writes the same chunk bytes and the same cache bytes
for the four formats this code knew. Do not "fix" or restyle it: it is the
reference, not code under test.
"""

# ruff: noqa

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from pydantic import BaseModel

from kvplug import KVConnector, KVLayout
from kvplug.errors import LayoutError

LayerCache = object


@dataclass(frozen=True)
class SlotPlan:
    """Slots of a chunk, and the blocks they fill when they fill whole blocks."""

    slots: torch.Tensor
    blocks: torch.Tensor | None
    block_offsets: tuple[torch.Tensor, torch.Tensor]


class ReferenceConnector(KVConnector):
    """kvplug 0.1's TorchConnector, verbatim but for the class name and ``kind``."""

    name = "reference"

    def __init__(self, config: BaseModel, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self._scratch = threading.local()

    def plan(self, slots: torch.Tensor) -> SlotPlan:
        size = self.layout.block_size
        slots = slots.to(torch.long)
        blocks = torch.div(slots, size, rounding_mode="floor")
        blocks_only = None
        if size > 1 and slots.numel() and slots.numel() % size == 0:
            rows = slots.view(-1, size)
            first = rows[:, :1]
            if bool(((first % size) == 0).all()) and bool(
                (rows == first + torch.arange(size, device=slots.device)).all()
            ):
                blocks_only = blocks.view(-1, size)[:, 0].contiguous()
        return SlotPlan(slots, blocks_only, (blocks, slots % size))

    def gather_layer(self, layer_cache: LayerCache, plan: SlotPlan, out: torch.Tensor) -> None:
        kind = self.layout.format.name  # 0.1: self.layout.kind
        if kind == "sglang_mha":
            for index, buffer in enumerate(layer_cache):
                _gather_rows(buffer.flatten(1), plan.slots, out[index])
        elif kind == "vllm_mla":
            if plan.blocks is not None and layer_cache.is_contiguous():
                _gather_rows(layer_cache.flatten(1), plan.blocks, out[0].view(plan.blocks.numel(), -1))
            else:
                _gather_rows(layer_cache.flatten(0, 1), plan.slots, out[0])
        elif kind == "vllm_flash":
            if layer_cache.is_contiguous() and plan.blocks is not None and out.is_contiguous():
                # K and V in one call: [2, blocks, block bytes] -> [2, chunk blocks, block bytes]
                rows = layer_cache.view(2, layer_cache.shape[1], -1)
                _gather_rows(rows, plan.blocks, out.view(2, plan.blocks.numel(), -1), dim=1)
            elif layer_cache.is_contiguous():
                for index in range(2):
                    _gather_rows(layer_cache[index].flatten(0, 1).flatten(1), plan.slots, out[index])
            else:
                blocks, offsets = plan.block_offsets
                out.copy_(layer_cache[:, blocks, offsets].flatten(2))  # [2, n, H*D]
        else:  # vllm_cpu: whole opaque blocks, memory order [blocks, heads, K|V, block_size * head_dim]
            heads, dim = self.layout.num_kv_heads, self.layout.head_dim
            blocks = self._whole_blocks(plan)
            # Pick whole blocks with one word copy into reused scratch, then reorder from
            # there: indexing the permuted cache directly runs element by element.
            picked = self._cpu_scratch(layer_cache, blocks.numel())  # [nb, H, 2, BS, D]
            _gather_rows(layer_cache.view(layer_cache.shape[0], -1), blocks, picked.view(blocks.numel(), -1))
            out.view(2, -1, self.layout.block_size, heads, dim).copy_(picked.permute(2, 0, 3, 1, 4))

    def scatter_layer(self, layer_cache: LayerCache, plan: SlotPlan, src: torch.Tensor) -> None:
        kind = self.layout.format.name  # 0.1: self.layout.kind
        device = (layer_cache[0] if kind == "sglang_mha" else layer_cache).device
        src = src.to(device, non_blocking=True)
        if kind == "sglang_mha":
            for index, buffer in enumerate(layer_cache):
                _scatter_rows(buffer.view(buffer.shape[0], -1), plan.slots.to(device), src[index])
        elif kind == "vllm_mla":
            if plan.blocks is not None and layer_cache.is_contiguous():
                _scatter_rows(layer_cache.view(layer_cache.shape[0], -1), plan.blocks.to(device), src[0])
            else:
                _scatter_rows(layer_cache.view(-1, layer_cache.shape[-1]), plan.slots.to(device), src[0])
        elif kind == "vllm_flash":
            if layer_cache.is_contiguous() and plan.blocks is not None:
                rows = layer_cache.view(2, layer_cache.shape[1], -1)  # K and V rows of a block together
                _scatter_rows(rows, plan.blocks.to(device), src.reshape(2, plan.blocks.numel(), -1), dim=1)
            elif layer_cache.is_contiguous():
                slots = plan.slots.to(device)
                for index in range(2):
                    _scatter_rows(layer_cache[index].view(-1, self.layout.token_width), slots, src[index])
            else:
                blocks, offsets = (t.to(device) for t in plan.block_offsets)
                layer_cache[:, blocks, offsets] = src.view(2, -1, self.layout.num_kv_heads, self.layout.head_dim)
        else:
            heads, dim = self.layout.num_kv_heads, self.layout.head_dim
            blocks = self._whole_blocks(plan).to(device)
            staged = self._cpu_scratch(layer_cache, blocks.numel())  # [nb, H, 2, BS, D], in cache memory order
            staged.copy_(src.reshape(2, blocks.numel(), self.layout.block_size, heads, dim).permute(1, 3, 0, 2, 4))
            _scatter_rows(layer_cache.view(layer_cache.shape[0], -1), blocks, staged.view(blocks.numel(), -1))

    def _whole_blocks(self, plan: SlotPlan) -> torch.Tensor:
        if plan.blocks is None:
            raise LayoutError(
                "layout vllm_cpu packs tokens inside a block per CPU ISA, so only whole "
                f"blocks of {self.layout.block_size} tokens can be copied; got "
                f"{plan.slots.numel()} slots that do not fill whole blocks in order"
            )
        return plan.blocks

    def _cpu_scratch(self, layer_cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """This thread's staging for ``num_blocks`` vllm_cpu blocks, ``[nb, H, 2, BS, D]``.

        Reused across calls: a fresh megabyte per layer would be fresh pages, and
        faulting them in costs more than the copy.
        """
        layout = self.layout
        shape = (num_blocks, layout.num_kv_heads, 2, layout.block_size, layout.head_dim)
        scratch = getattr(self._scratch, "tensor", None)
        needed = num_blocks * (layer_cache.numel() // layer_cache.shape[0])
        if scratch is None or scratch.numel() < needed or scratch.dtype != layer_cache.dtype:
            scratch = self._scratch.tensor = torch.empty(needed, dtype=layer_cache.dtype, device=layer_cache.device)
        return scratch[:needed].view(shape)


def _gather_rows(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor, dim: int = 0) -> None:
    """``out[i] = rows[index[i]]`` along ``dim``, straight into ``out`` on the same device."""
    index = index.to(rows.device)
    if rows.device == out.device and rows.is_contiguous() and out.is_contiguous():
        if rows.device.type == "cpu":
            rows, out = _as_words(rows, out)
        torch.index_select(rows, dim, index, out=out)
    else:
        out.copy_(rows.index_select(dim, index))


def _scatter_rows(rows: torch.Tensor, index: torch.Tensor, src: torch.Tensor, dim: int = 0) -> None:
    """``rows[index[i]] = src[i]`` along ``dim`` (0, or 1 for K/V pairs), in place in the cache."""
    if dim == 0:
        rows, src = rows.unsqueeze(0), src.reshape(1, index.numel(), -1)
    else:
        src = src.reshape(rows.shape[0], index.numel(), -1)
    if rows.device.type == "cpu":
        # Also the only way for fp8: index_copy_ has no float8 kernel.
        rows, src = _as_words(rows, src.contiguous())
    rows.index_copy_(1, index, src)


#: Integer words the CPU copies run on, widest first.
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _as_words(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of same-dtype tensors as the widest integer word every row, stride and offset allows.

    torch's CPU ``index_copy_`` copies 2-byte and 1-byte elements one at a time
    (and has no fp8 kernel); on 8-byte words it ran 1.5-2x faster on vLLM blocks
    here. Copying words is bit exact for any dtype.
    """
    itemsize = tensors[0].element_size()
    for word in _WORDS:
        size = word.itemsize
        if size >= itemsize and all(_divides(size, t, itemsize) for t in tensors):
            return tuple(t.view(word) for t in tensors)
    return tensors


def _divides(size: int, tensor: torch.Tensor, itemsize: int) -> bool:
    """Whether ``tensor`` (rows contiguous) can be viewed as words of ``size`` bytes."""
    if tensor.dim() == 0 or tensor.stride(-1) != 1:
        return False
    quantities = (tensor.shape[-1], tensor.storage_offset(), *tensor.stride()[:-1])
    return all(q * itemsize % size == 0 for q in quantities)
