"""Where each token's K and V rows live in an engine's paged cache, in machine words.

Every :class:`kvplug.PagedFormat` that is not ``whole_blocks_only`` reduces to one
addressing scheme through :meth:`kvplug.KVLayout.kv_views` (one strided view per K/V
index, ``[pages, page_tokens, heads, head_dim]``), so one kernel serves them all. For
layer ``l``, K/V index ``k``, slot ``s`` (page ``b = s // B``, offset ``o = s % B``,
``B`` the page's tokens), head ``h`` and word ``d`` of the head::

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
from typing import TYPE_CHECKING

from kvplug import KVLayout, LazyModule
from kvplug.errors import LayoutError

if TYPE_CHECKING:
    import torch
else:  # imported on first use: ``kvplug plugins`` and ``config validate`` load this module without torch
    torch = LazyModule("torch")

#: Machine words the kernels copy, widest first (torch dtype names: the module loads without torch).
_WORDS = ("int64", "int32", "int16", "int8")


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
    strides: tuple[int, int, int]  # page, token-in-page, head; in elements
    num_slots: int


def kernel_fits(layout: KVLayout) -> bool:
    """Whether the kernel addresses this format: any whose tokens are addressable and whose head rows are runs.

    ``whole_blocks_only`` formats pack a block's bytes engine-privately (vLLM's CPU
    backend, per ISA, in host memory): only the torch connector's whole-block copy fits.
    The kernel copies a head's elements as one run of words, so ``dim`` must be the
    innermost axis; other formats go to the torch connector too.
    """
    return not layout.whole_blocks_only and (layout.format.axes[-1] == "dim" or layout.head_dim == 1)


def layer_tensors(layout: KVLayout, cache: object) -> tuple[torch.Tensor, ...]:
    """The tensors of one layer's cache (one, or K and V apart, as the format says)."""
    return layout.layer_tensors(cache)


def base_tensor(layout: KVLayout, caches: Sequence[object], word: torch.dtype) -> torch.Tensor:
    """A one-word view at layer 0's origin: what the kernel's ``cache_ptr`` points at."""
    first = layer_tensors(layout, caches[0])[0]
    # word is never narrower than the element: every address and stride is a multiple of it
    count = _size(word) // first.element_size()
    return first.as_strided((count,), (1,)).view(word)


def cache_key(layout: KVLayout, caches: Sequence[object]) -> tuple[object, ...]:
    """Identifies a set of layer caches by address, shape and strides (for reuse of tables)."""
    return tuple(
        (t.data_ptr(), tuple(t.shape), t.stride(), t.device) for cache in caches for t in layer_tensors(layout, cache)
    )


def paged_addressing(layout: KVLayout, caches: Sequence[object]) -> PagedAddressing:
    """Describe ``caches`` (one entry per layer, all alike) for the paged-copy kernel."""
    if not kernel_fits(layout):
        raise LayoutError(
            f"the paged-copy kernel does not address {layout.format.name} {layout.format.axes}: it copies whole "
            "blocks only (bytes inside a block are engine-private), or head_dim is not its innermost axis"
        )
    if not caches:
        raise LayoutError("no layer caches given")
    origins = [_origins(layout, cache) for cache in caches]
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
    word = next(w for w in map(_dtype, _WORDS) if all(q % _size(w) == 0 for q in byte_quantities))
    size = _size(word)
    table = torch.tensor([(p - base) // size for p in pointers], dtype=torch.int64)
    head_words = layout.head_dim * itemsize // size
    return PagedAddressing(
        word=word,
        table=table.to(sample.device),
        num_layers=len(caches),
        num_kv=layout.num_kv,
        block_size=layout.page_tokens,
        num_slots=first.num_slots,
        stride_block=first.strides[0] * itemsize // size,
        stride_offset=first.strides[1] * itemsize // size,
        stride_head=first.strides[2] * itemsize // size,
        head_words=head_words,
        row_words=head_words * layout.num_kv_heads,
    )


def _dtype(name: str) -> torch.dtype:
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def _size(word: torch.dtype) -> int:
    return torch.empty((), dtype=word).element_size()


def _origins(layout: KVLayout, cache: object) -> _Origins:
    views = layout.kv_views(cache)  # [pages, page_tokens, heads, head_dim] per K/V index
    first = views[0]
    for view in views:
        if view.stride(-1) != 1 and layout.head_dim != 1:
            raise LayoutError(
                f"{layout.format.name} cache rows must be contiguous in head_dim; view strides are {view.stride()}"
            )
        if view.shape != first.shape or view.stride() != first.stride():
            raise LayoutError(
                f"{layout.format.name} K and V differ: {tuple(first.shape)}/{first.stride()} vs "
                f"{tuple(view.shape)}/{view.stride()}"
            )
    # a dim of size 1 is never stepped along: stride 0 keeps it out of the word-size choice
    page, token, head = (first.stride(i) if first.shape[i] > 1 else 0 for i in range(3))
    return _Origins(tuple(v.data_ptr() for v in views), (page, token, head), first.shape[0] * first.shape[1])
