"""Where each token's K and V rows live in an engine's paged cache, in machine words.

The GPU layouts (vllm_flash, vllm_mla, sglang_mha) reduce to one addressing
scheme, so one kernel serves them all. For layer ``l``, K/V index ``k``, slot ``s`` (block ``b = s // B``,
offset ``o = s % B``), head ``h`` and word ``d`` of the head::

    address = base + table[l * num_kv + k] + b * stride_block + o * stride_offset
              + h * stride_head + d

``table`` holds the word offset of each layer's K and V origin from ``base``
(layer 0's first tensor), so all layers of a chunk, even separately allocated
ones, are reached from one kernel launch. Copying machine words (int64 down to
int8, the widest the head row and every stride and pointer allow) instead of the
cache's dtype makes every dtype, fp8 included, bit exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvplug import KVLayout
from kvplug.errors import LayoutError

#: Layouts the kernel addresses. vllm_cpu is absent: its caches live in host memory
#: and its blocks are packed per CPU ISA, so only the torch connector's whole-block copy fits.
KERNEL_LAYOUTS: tuple[str, ...] = ("vllm_flash", "vllm_mla", "sglang_mha")

#: Machine words the kernels copy, widest first.
_WORDS: tuple[torch.dtype, ...] = (torch.int64, torch.int32, torch.int16, torch.int8)


@dataclass(frozen=True)
class PagedAddressing:
    """Word-level addressing of one or more layers of a paged cache (no tensor references)."""

    word: torch.dtype
    table: torch.Tensor  # int64 [num_layers * num_kv], word offsets from the base pointer
    num_layers: int
    num_kv: int
    block_size: int
    num_slots: int
    stride_block: int
    stride_offset: int
    stride_head: int
    head_words: int
    row_words: int

    @property
    def heads_packed(self) -> bool:
        """Heads follow each other in memory, so a token's row is one contiguous run."""
        return self.stride_head == self.head_words or self.row_words == self.head_words

    @property
    def word_size(self) -> int:
        return torch.empty((), dtype=self.word).element_size()


@dataclass(frozen=True)
class _Origins:
    """Per-layer K/V origins (byte addresses) and element strides of one layer."""

    pointers: tuple[int, ...]
    strides: tuple[int, int, int]  # block, offset-in-block, head; in elements
    num_slots: int


def layer_tensors(layout: KVLayout, cache: object) -> tuple[torch.Tensor, ...]:
    """The tensors of one layer's cache (SGLang keeps K and V apart)."""
    tensors = tuple(cache) if isinstance(cache, (tuple, list)) else (cache,)
    expected = 2 if layout.kind == "sglang_mha" else 1
    if len(tensors) != expected or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise LayoutError(f"a {layout.kind} layer cache is {expected} tensor(s), got {type(cache).__name__}")
    return tensors


def base_tensor(layout: KVLayout, caches: Sequence[object], word: torch.dtype) -> torch.Tensor:
    """A one-word view at layer 0's origin: what the kernel's ``cache_ptr`` points at."""
    first = layer_tensors(layout, caches[0])[0]
    # word is never narrower than the element: every address and stride is a multiple of it
    count = _size(word) // first.element_size()
    return first.as_strided((count,), (1,)).view(word)


def cache_key(layout: KVLayout, caches: Sequence[object]) -> tuple:
    """Identifies a set of layer caches by address, shape and strides (for reuse of tables)."""
    return tuple(
        (t.data_ptr(), tuple(t.shape), t.stride(), t.device) for cache in caches for t in layer_tensors(layout, cache)
    )


def paged_addressing(layout: KVLayout, caches: Sequence[object]) -> PagedAddressing:
    """Describe ``caches`` (one entry per layer, all alike) for the paged-copy kernel."""
    if layout.kind not in KERNEL_LAYOUTS:
        raise LayoutError(
            f"the paged-copy kernel does not address {layout.kind}; kernels cover {', '.join(KERNEL_LAYOUTS)}"
        )
    if not caches:
        raise LayoutError("no layer caches given")
    origins = [_origins(layout, layer_tensors(layout, cache)) for cache in caches]
    first = origins[0]
    for index, other in enumerate(origins[1:], start=1):
        if other.strides != first.strides or other.num_slots != first.num_slots:
            raise LayoutError(
                f"layer {index} has strides {other.strides} and {other.num_slots} slots; layer 0 has "
                f"{first.strides} and {first.num_slots}: one kernel launch needs alike layers"
            )
    sample = layer_tensors(layout, caches[0])[0]
    devices = {t.device for cache in caches for t in layer_tensors(layout, cache)}
    if len(devices) != 1:
        raise LayoutError(f"layer caches are on several devices: {sorted(map(str, devices))}")
    itemsize = sample.element_size()
    base = first.pointers[0]
    pointers = [p for o in origins for p in o.pointers]
    byte_quantities = [layout.head_dim * itemsize, *(s * itemsize for s in first.strides), *pointers]
    word = next(w for w in _WORDS if all(q % _size(w) == 0 for q in byte_quantities))
    size = _size(word)
    table = torch.tensor([(p - base) // size for p in pointers], dtype=torch.int64)
    head_words = layout.head_dim * itemsize // size
    return PagedAddressing(
        word=word,
        table=table.to(sample.device),
        num_layers=len(caches),
        num_kv=layout.num_kv,
        block_size=layout.block_size if layout.kind != "sglang_mha" else 1,
        num_slots=first.num_slots,
        stride_block=first.strides[0] * itemsize // size,
        stride_offset=first.strides[1] * itemsize // size,
        stride_head=first.strides[2] * itemsize // size,
        head_words=head_words,
        row_words=head_words * layout.num_kv_heads,
    )


def _size(word: torch.dtype) -> int:
    return torch.empty((), dtype=word).element_size()


def _origins(layout: KVLayout, tensors: tuple[torch.Tensor, ...]) -> _Origins:
    kind, itemsize = layout.kind, tensors[0].element_size()
    for tensor in tensors:
        if tensor.stride(-1) != 1:
            raise LayoutError(f"{kind} cache rows must be contiguous in head_dim; strides are {tensor.stride()}")
    if kind == "vllm_flash":  # [2, num_blocks, block_size, heads, head_dim]
        cache = tensors[0]
        pointers = (cache.data_ptr(), cache.data_ptr() + cache.stride(0) * itemsize)
        return _Origins(pointers, (cache.stride(1), cache.stride(2), cache.stride(3)), cache.shape[1] * cache.shape[2])
    if kind == "vllm_mla":  # [num_blocks, block_size, head_dim], one latent "head"
        cache = tensors[0]
        return _Origins((cache.data_ptr(),), (cache.stride(0), cache.stride(1), 0), cache.shape[0] * cache.shape[1])
    # sglang_mha: separate K and V buffers [num_slots, heads, head_dim]
    k_buffer, v_buffer = tensors
    if k_buffer.stride() != v_buffer.stride() or k_buffer.shape != v_buffer.shape:
        raise LayoutError(
            f"sglang K and V buffers differ: {k_buffer.shape}/{k_buffer.stride()} vs {v_buffer.shape}/{v_buffer.stride()}"
        )
    return _Origins(
        (k_buffer.data_ptr(), v_buffer.data_ptr()), (k_buffer.stride(0), 0, k_buffer.stride(1)), k_buffer.shape[0]
    )
