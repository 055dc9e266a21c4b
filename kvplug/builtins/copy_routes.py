"""Routes: which copies the torch connector can make for a layer's cache, worked out once per geometry.

A route holds a layer's kv_views (:meth:`kvplug.KVLayout.kv_views`) and, where the
strides allow, views of them as rows: whole pages, K and V stacked in one tensor,
token rows. Views are kept as shapes, strides and offsets without the tensors, so a
route serves every layer of the same geometry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvplug.core.layouts import KVLayout
from kvplug.core.lazy_module import LazyModule

if TYPE_CHECKING:
    import torch
else:  # imported on first use: ``kvplug plugins`` and ``config validate`` load this module without torch
    torch = LazyModule("torch")


@dataclass(frozen=True)
class Strided:
    """A strided view of one of a layer's tensors, kept without the tensor (offset relative to its own)."""

    tensor: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def of(self, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        base = tensors[self.tensor]
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.offset)


@dataclass(frozen=True)
class Route:
    """How to copy one layer of a given geometry: its kv_views and the row views the fast paths use."""

    views: tuple[Strided, ...]  # kv_views: [pages, page_tokens, heads, head_dim] per K/V index
    stacked: Strided | None  # [num_kv, pages, page_tokens, heads, head_dim]: K and V at one stride in one tensor
    page_rows: tuple[Strided, ...] | None  # [pages, page elements] per K/V, when every page is one run
    stacked_page_rows: Strided | None  # [num_kv, pages, page elements], K and V in one call
    token_rows: tuple[Strided, ...] | None  # [pages * page_tokens, heads * head_dim] per K/V, rows one run apart


def find_route(layout: KVLayout, tensors: tuple[torch.Tensor, ...]) -> Route:
    """Work out, once per geometry, which copies the kv_views of ``tensors`` allow."""
    views = layout.kv_views(tensors if len(tensors) > 1 else tensors[0])
    # kv_views gives num_kv views per tensor, in tensor order
    per_tensor = len(views) // len(tensors)
    strided = tuple(
        Strided(
            i // per_tensor,
            tuple(v.shape),
            v.stride(),
            int(v.storage_offset()) - int(tensors[i // per_tensor].storage_offset()),
        )
        for i, v in enumerate(views)
    )
    stacked = _stacked(strided)
    page_rows = token_rows = stacked_page_rows = None
    if all(dense(v.size[1:], v.stride[1:]) for v in strided):
        page_rows = tuple(_rows(v, 1) for v in strided)
        if stacked is not None and len(strided) > 1:
            stacked_page_rows = _rows(stacked, 2)
    if all(_token_rows_dense(v) for v in strided):
        token_rows = tuple(_token_rows(v) for v in strided)
    return Route(strided, stacked, page_rows, stacked_page_rows, token_rows)


def dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether dims of these sizes and strides are one run of memory in order (size-1 dims ignored)."""
    step = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != step:
            return False
        step *= size
    return True


def _token_rows_dense(view: Strided) -> bool:
    """A kv_view's token rows (heads, dims) are runs, and pages follow each other at one token stride."""
    pages, tokens, heads, dim = view.size
    if not dense((heads, dim), view.stride[2:]):
        return False
    return tokens == 1 or pages <= 1 or view.stride[0] == tokens * view.stride[1]


def _rows(view: Strided, keep: int) -> Strided:
    """A view whose dims after the first ``keep`` are one run, as ``[*first keep dims, run]``."""
    size = (*view.size[:keep], math.prod(view.size[keep:]))
    return Strided(view.tensor, size, (*view.stride[:keep], 1), view.offset)


def _token_rows(view: Strided) -> Strided:
    """A token-row-dense view as ``[pages * page_tokens, heads * dims]`` rows, one per slot."""
    pages, tokens, heads, dim = view.size
    stride = view.stride[1] if tokens > 1 else view.stride[0]
    return Strided(view.tensor, (pages * tokens, heads * dim), (stride, 1), view.offset)


def _stacked(views: tuple[Strided, ...]) -> Strided | None:
    """The K/V views as one ``[num_kv, ...]`` view when one tensor holds them at a constant stride."""
    first = views[0]
    if len(views) == 1:
        return Strided(first.tensor, (1, *first.size), (0, *first.stride), first.offset)
    delta = views[1].offset - first.offset
    if delta <= 0 or any(
        v.tensor != first.tensor
        or v.size != first.size
        or v.stride != first.stride
        or v.offset - first.offset != i * delta
        for i, v in enumerate(views)
    ):
        return None
    return Strided(first.tensor, (len(views), *first.size), (delta, *first.stride), first.offset)
