"""Checks of the chunk tensors a connector copies, against their plans and the layers of the cache.

The copies trust shapes and dtypes. Given a chunk with fewer tokens than its plan, or
of another rank, torch resizes an ``out=`` tensor inside its storage with only a
warning, and the copy lands past the chunk's view: in a frame pool that is a
neighbouring frame of a shared segment. A layer of another dtype than the chunk would
be copied as the chunk's elements (other bytes, other sizes). A bad chunk or layer is
refused by name before anything is copied, with a few comparisons per chunk and per
layer, never per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvplug.core.connector import LayerCache
from kvplug.core.layouts import KVLayout
from kvplug.core.lazy_module import LazyModule
from kvplug.errors import LayoutError

if TYPE_CHECKING:
    import torch
else:  # imported on first use: ``kvplug plugins`` and ``config validate`` load this module without torch
    torch = LazyModule("torch")


def check_chunks(
    layout: KVLayout,
    kv_caches: Sequence[LayerCache],
    layers: range,
    num_tokens: Sequence[int],
    chunks: Sequence[torch.Tensor],
) -> None:
    """Each chunk ``[>= layers.stop, num_kv, n, token_width]`` for its plan's ``n`` slots, and every tensor of
    ``layers`` of the chunks' dtype: else :class:`LayoutError` naming the chunk or the layer."""
    kv, width = layout.num_kv, layout.token_width
    for index, (count, chunk) in enumerate(zip(num_tokens, chunks)):
        if chunk.dim() != 4 or chunk.shape[0] < layers.stop or chunk.shape[1:] != (kv, count, width):
            raise LayoutError(
                f"chunk {index} of the call, for {count} planned slots of layers {layers.start}-{layers.stop - 1}, "
                f"must be shaped [>= {layers.stop}, {kv}, {count}, {width}] (num_layers, num_kv, tokens, "
                f"token_width), got {list(chunk.shape)}"
            )
    dtypes = {chunk.dtype for chunk in chunks}
    for layer in layers if dtypes else ():  # no chunks: nothing is copied
        check_dtypes(layout.layer_tensors(kv_caches[layer]), dtypes, layer)


def check_chunk_layer(
    kv_width: tuple[int, int], tensors: Sequence[torch.Tensor], num_tokens: int, chunk_layer: torch.Tensor
) -> None:
    """One layer of a chunk, ``[num_kv, n, token_width]`` for a plan of ``n`` slots (``kv_width``: the layout's
    ``(num_kv, token_width)``), of the dtype of every tensor of the layer."""
    # Called per layer and chunk by gather_layer/scatter_layer: plain comparisons, the rest only to raise.
    kv, width = kv_width
    if chunk_layer.shape != (kv, num_tokens, width):
        expected = [kv, num_tokens, width]
        raise LayoutError(
            f"a chunk layer for {num_tokens} planned slots must be shaped {expected} "
            f"(num_kv, tokens, token_width), got {list(chunk_layer.shape)}"
        )
    dtype = chunk_layer.dtype
    for tensor in tensors:
        if tensor.dtype != dtype:
            check_dtypes(tensors, {dtype})


def check_dtypes(tensors: Sequence[torch.Tensor], dtypes: set[torch.dtype], layer: int | None = None) -> None:
    """A chunk holds the cache's bytes as they are: the copies move words, so other dtypes are refused."""
    for tensor in tensors:
        if len(dtypes) > 1 or tensor.dtype not in dtypes:
            other = next(dtype for dtype in dtypes if dtype != tensor.dtype)
            where = "" if layer is None else f"layer {layer}: "
            raise LayoutError(f"{where}a chunk of {other} cannot be copied to or from a {tensor.dtype} KV cache")
