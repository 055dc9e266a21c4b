"""Whole-block copies of packed (``whole_blocks_only``) layouts, for the ``torch`` connector.

An engine that packs the tokens of a block in its own way lets only whole blocks be
copied. The chunk holds blocks as the engine stores them, split by K/V index only
(:meth:`kvplug.KVLayout.packed_block_split`), so every copy moves runs of whole heads.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvplug.builtins.copy_routes import dense
from kvplug.builtins.index_runs import IndexRuns, gather_runs, scatter_runs
from kvplug.builtins.row_copies import gather_rows, scatter_rows
from kvplug.core.layouts import KVLayout
from kvplug.core.lazy_module import LazyModule
from kvplug.errors import LayoutError

if TYPE_CHECKING:
    import torch
else:  # imported on first use: ``kvplug plugins`` and ``config validate`` load this module without torch
    torch = LazyModule("torch")


class PackedBlockCopies:
    """Gathers and scatters whole blocks of one packed layout; thread-safe (scratch is per thread)."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        # Asked on every copy of a packed block: once here, not per chunk and layer.
        self._split = layout.packed_block_split()
        self._scratch = threading.local()

    def gather(
        self, tensors: tuple[torch.Tensor, ...], blocks: torch.Tensor, runs: IndexRuns | None, out: torch.Tensor
    ) -> None:
        """Copy ``blocks`` of a layer's ``tensors`` into the chunk layer ``out``; ``runs``: of ``blocks``."""
        parts = self._chunk_parts(out, blocks.numel())
        if runs is not None and runs.worth_slicing and out.device == tensors[0].device:
            for tensor, part in zip(tensors, parts):
                gather_runs(self._packed_blocks(tensor), runs, part, dim=1)
            return
        # Pick whole blocks with one word copy into reused scratch, then split K and V
        # from there: a block at a time, indexing runs far below copy_'s speed.
        staging = self._staging(tensors, blocks.numel())
        for tensor, rows, staged, part in zip(tensors, staging.rows, staging.parts, parts):
            gather_rows(self._block_rows(tensor), blocks, rows)
            part.copy_(staged)

    def scatter(
        self, tensors: tuple[torch.Tensor, ...], blocks: torch.Tensor, runs: IndexRuns | None, src: torch.Tensor
    ) -> None:
        """Copy the chunk layer ``src`` into ``blocks`` of a layer's ``tensors``; ``runs``: of ``blocks``."""
        device = tensors[0].device
        parts = self._chunk_parts(src.to(device, non_blocking=True), blocks.numel(), read_only=True)
        block_bytes = math.prod(tensors[0].shape[1:]) * tensors[0].element_size()
        if runs is not None and runs.worth_slicing_writes(block_bytes):
            for tensor, part in zip(tensors, parts):
                scatter_runs(self._packed_blocks(tensor), runs, part, dim=1)
            return
        blocks = blocks.to(device)
        staging = self._staging(tensors, blocks.numel())  # blocks as the cache stores them
        for tensor, rows, staged, part in zip(tensors, staging.rows, staging.parts, parts):
            staged.copy_(part)
            scatter_rows(self._block_rows(tensor), blocks, rows)

    def _chunk_parts(self, chunk_layer: torch.Tensor, num_blocks: int, read_only: bool = False) -> list[torch.Tensor]:
        """A chunk layer ``[num_kv, tokens, token_width]`` as ``[kv, blocks, outer, inner]``, one per layer tensor.

        Views of the chunk's memory; a chunk only read may be copied into that shape.
        """
        outer, kv, inner = self._split
        shape = (self.layout.num_kv, num_blocks, outer, inner)
        blocks = chunk_layer.reshape(shape) if read_only else chunk_layer.view(shape)
        return [blocks[i * kv : (i + 1) * kv] for i in range(self.layout.format.tensors)]

    def _packed_blocks(self, rows: torch.Tensor) -> torch.Tensor:
        """A layer tensor (or staged rows of one) as ``[kv, blocks, outer, inner]``: views of its memory."""
        outer, kv, inner = self._split
        block_rows = self._block_rows(rows)
        return block_rows.view(block_rows.shape[0], outer, kv, inner).permute(2, 0, 1, 3)

    def _block_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as ``[num_blocks, elements per block]`` rows: each block is one run of memory."""
        if tensor.is_contiguous():
            return tensor.view(tensor.shape[0], -1)
        if not dense(tensor.shape[1:], tensor.stride()[1:]):
            raise LayoutError(
                f"layout {self.layout.format.name}: a block of the cache tensor {tuple(tensor.shape)} with strides "
                f"{tensor.stride()} is not one run of memory; whole-block copies need dense blocks"
            )
        return tensor.as_strided((tensor.shape[0], math.prod(tensor.shape[1:])), (tensor.stride(0), 1))

    def _staging(self, tensors: tuple[torch.Tensor, ...], num_blocks: int) -> _Staging:
        """This thread's staging for ``num_blocks`` whole blocks of each layer tensor.

        The scratch memory is reused across calls (a fresh megabyte per layer would be
        fresh pages, and faulting them in costs more than the copy), and so are its
        views, one set per block count.
        """
        first = tensors[0]
        key = (num_blocks, first.shape[1:], first.dtype, first.device, len(tensors))
        local = self._scratch
        staging: _Staging | None = getattr(local, "views", {}).get(key)
        if staging is not None:
            return staging
        needed = num_blocks * math.prod(first.shape[1:])
        scratch = getattr(local, "tensor", None)
        if (
            scratch is None
            or scratch.numel() < needed * len(tensors)
            or scratch.dtype != first.dtype
            or scratch.device != first.device
        ):
            scratch = local.tensor = torch.empty(needed * len(tensors), dtype=first.dtype, device=first.device)
            local.views = {}  # views of the old scratch must not outlive it
        rows = [scratch[i * needed : (i + 1) * needed].view(num_blocks, -1) for i in range(len(tensors))]
        staging = _Staging(rows, [self._packed_blocks(row) for row in rows])
        local.views[key] = staging
        return staging


@dataclass(frozen=True)
class _Staging:
    """Scratch for whole blocks: rows as picked from the cache, and their K/V split."""

    rows: list[torch.Tensor]  # [num_blocks, block elements] per layer tensor
    parts: list[torch.Tensor]  # the same memory as [kv, num_blocks, outer, inner] (packed_block_split)
