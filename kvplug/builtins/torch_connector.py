"""KV connector ``torch``: gather/scatter with plain torch indexing, on any device.

It is the reference every faster connector (kvplug-cuda's kernels) is checked
against, so it favours obvious correctness; contiguous caches still take a
single ``index_select``/``index_copy_`` per layer and K/V.
"""

from __future__ import annotations

import torch

from kvplug.core.connector import KVConnector, LayerCache
from kvplug.hookspecs import hookimpl


class TorchConnector(KVConnector):
    """Works for every :class:`kvplug.KVLayout` kind and every device torch has."""

    name = "torch"

    def gather_layer(self, layer_cache: LayerCache, slots: torch.Tensor, out: torch.Tensor) -> None:
        kind = self.layout.kind
        if kind == "sglang_mha":
            for index, buffer in enumerate(layer_cache):
                _gather_rows(buffer.flatten(1), slots, out[index])
        elif kind == "vllm_mla":
            _gather_rows(layer_cache.flatten(0, 1), slots, out[0])
        elif kind == "vllm_flash":
            if layer_cache.is_contiguous():
                for index in range(2):
                    _gather_rows(layer_cache[index].flatten(0, 1).flatten(1), slots, out[index])
            else:
                blocks, offsets = self._split(slots)
                picked = layer_cache[:, blocks, offsets]  # [2, n, H, D]
                out.copy_(picked.flatten(2))
        else:  # vllm_cpu: memory order [blocks, heads, K|V, block_size, head_dim]
            blocks, offsets = self._split(slots)
            picked = self._cpu_view(layer_cache)[blocks, :, :, offsets]  # [n, H, 2, D]
            out.view(2, -1, self.layout.num_kv_heads, self.layout.head_dim).copy_(
                picked.permute(2, 0, 1, 3)
            )

    def scatter_layer(self, layer_cache: LayerCache, slots: torch.Tensor, src: torch.Tensor) -> None:
        kind = self.layout.kind
        device = (layer_cache[0] if kind == "sglang_mha" else layer_cache).device
        src = src.to(device, non_blocking=True)
        slots = slots.to(device)
        if kind == "sglang_mha":
            for index, buffer in enumerate(layer_cache):
                buffer.view(buffer.shape[0], -1).index_copy_(0, slots, src[index])
        elif kind == "vllm_mla":
            layer_cache.view(-1, layer_cache.shape[-1]).index_copy_(0, slots, src[0])
        elif kind == "vllm_flash":
            if layer_cache.is_contiguous():
                layer_cache.view(2, -1, self.layout.token_width).index_copy_(1, slots, src)
            else:
                blocks, offsets = self._split(slots)
                heads, dim = self.layout.num_kv_heads, self.layout.head_dim
                layer_cache[:, blocks, offsets] = src.view(2, -1, heads, dim)
        else:
            blocks, offsets = self._split(slots)
            heads, dim = self.layout.num_kv_heads, self.layout.head_dim
            self._cpu_view(layer_cache)[blocks, :, :, offsets] = src.view(
                2, -1, heads, dim
            ).permute(1, 2, 0, 3)

    def _split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.div(slots, self.layout.block_size, rounding_mode="floor"), slots % self.layout.block_size

    def _cpu_view(self, layer_cache: torch.Tensor) -> torch.Tensor:
        num_blocks = layer_cache.shape[0]
        layout = self.layout
        return layer_cache.view(num_blocks, layout.num_kv_heads, 2, layout.block_size, layout.head_dim)


def _gather_rows(rows: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = rows[slots[i]]``, straight into ``out`` when it is on the same device."""
    if rows.device == out.device and rows.is_contiguous():
        torch.index_select(rows, 0, slots.to(rows.device), out=out)
    else:
        out.copy_(rows.index_select(0, slots.to(rows.device)), non_blocking=False)


@hookimpl
def kvplug_kv_connectors() -> list[type]:
    return [TorchConnector]
