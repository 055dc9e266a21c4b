"""Formats, caches and slot draws shared by the kvplug-native tests.

Imported by name (``from native_helpers import ...``), like the core's ``core_helpers``:
a conftest is not importable once several test folders run in one pytest session.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from hypothesis import strategies as st

import kvplug
from kvplug import KVLayout, PagedFormat

FLASH = PagedFormat("native_test_flash", ("kv", "block", "token", "head", "dim"))
HND = PagedFormat("native_test_hnd", ("kv", "block", "head", "token", "dim"))
MLA = PagedFormat("native_test_mla", ("block", "token", "dim"), latent=True)
#: a latent cache with a one-head axis between block and token (vLLM's CPU MLA cache)
MLA_HEAD = PagedFormat("native_test_mla_head", ("block", "head", "token", "dim"), latent=True)
PACKED = PagedFormat("native_test_packed", ("block", "head", "kv", "token", "dim"), whole_blocks_only=True)
SLOTS_KV = PagedFormat("native_test_slots_kv", ("slot", "head", "dim"), tensors=2)
PACKED_KV = PagedFormat("native_test_packed_kv", ("block", "head", "token", "dim"), tensors=2, whole_blocks_only=True)
#: ``dim`` is not the innermost axis: no run table addresses it, the torch connector copies.
DIM_OUTER = PagedFormat("native_test_dim_outer", ("kv", "block", "token", "dim", "head"))

#: The byte unwritten memory holds in these tests; random bytes never take it.
UNWRITTEN = 0xFF

FORMATS = (FLASH, HND, MLA, MLA_HEAD, PACKED, SLOTS_KV, PACKED_KV, DIM_OUTER)
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def one_head(fmt: PagedFormat) -> bool:
    return fmt.latent or "head" not in fmt.axes


def random_bytes(shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """A contiguous tensor of random bytes viewed as ``dtype`` (NaN patterns included).

    Bytes are 0..254, never :data:`UNWRITTEN`, so a byte copied over an unwritten one always changes it.
    """
    shape = list(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, UNWRITTEN, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=generator)
    return raw.view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality of two tensors of any dtype (NaNs compare by their bytes)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(dense_bytes(a), dense_bytes(b))


def dense_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in its logical order, for tensors of any strides."""
    return t.contiguous().reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class Geometry:
    """How each layer tensor sits in memory: ``order`` of the declared axes (outermost first), padding.

    ``pad_inner``: elements after the innermost axis of each row (runs of a token are not
    one run then); ``pad_outer``: elements after each slice of the outermost axis.
    """

    order: tuple[int, ...] | None = None  # None: the declared order (contiguous)
    pad_inner: int = 0
    pad_outer: int = 0


@dataclass
class Caches:
    """An engine's per-layer caches and the allocations behind them (padding included), for byte comparisons."""

    layers: list[Any]  # per layer: a tensor, or (K, V)
    bases: list[torch.Tensor]  # every allocation, contiguous
    _views: list[tuple[int, tuple[int, ...], tuple[int, ...], int]]  # (base, shape, stride, offset) per tensor
    _tensors: int

    def clone(self, fill: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Caches:
        """Same geometry; contents copied, or ``fill(base)`` per allocation."""
        bases = [base.clone() if fill is None else fill(base) for base in self.bases]
        return _assemble(bases, self._views, self._tensors)

    def same_bytes(self, other: Caches) -> bool:
        return all(same_bytes(a, b) for a, b in zip(self.bases, other.bases, strict=True))


def _assemble(bases: list[torch.Tensor], views: list[Any], tensors: int) -> Caches:
    made = [bases[i].as_strided(shape, stride, offset) for i, shape, stride, offset in views]
    layers: list[Any] = made if tensors == 1 else [tuple(made[i : i + 2]) for i in range(0, len(made), 2)]
    return Caches(layers, bases, views, tensors)


def make_caches(
    layout: KVLayout,
    num_blocks: int,
    generator: torch.Generator,
    geometries: Sequence[Geometry] | None = None,
) -> Caches:
    """Random-byte caches of ``layout``, one geometry per layer (default: contiguous)."""
    fmt = layout.format
    declared = list(layout.cache_shape(num_blocks))
    bases: list[torch.Tensor] = []
    views = []
    for layer in range(layout.num_layers):
        geometry = geometries[layer] if geometries else Geometry()
        order = list(geometry.order or range(len(declared)))
        physical = [declared[i] for i in order]
        for _ in range(fmt.tensors):
            alloc = [*physical[:-1], physical[-1] + geometry.pad_inner]
            rows, rest = alloc[0], math.prod(alloc[1:])
            base = random_bytes((rows, rest + geometry.pad_outer), layout.dtype, generator)
            tensor = base[:, :rest].view(alloc)[..., : physical[-1]]
            tensor = tensor.permute([order.index(i) for i in range(len(declared))])
            bases.append(base)
            views.append((len(bases) - 1, tuple(tensor.shape), tensor.stride(), tensor.storage_offset()))
    return _assemble(bases, views, fmt.tensors)


def geometries(fmt: PagedFormat) -> st.SearchStrategy[Geometry]:
    """Geometries a layer tensor of ``fmt`` may have (packed formats need dense blocks, block first)."""
    pads = st.integers(0, 3)
    if fmt.whole_blocks_only:
        return st.builds(Geometry, pad_outer=pads)
    axes = len(fmt.axes)
    first = next(i for i, axis in enumerate(fmt.axes) if axis in ("block", "slot"))
    block_first = (first, *(i for i in range(axes) if i != first))
    # Mostly orders a run table addresses (``dim`` innermost); any order now and then (the torch fallback).
    orders = st.one_of(st.none(), st.just(block_first), st.none(), st.permutations(range(axes)).map(tuple))
    return st.builds(Geometry, order=orders, pad_inner=pads, pad_outer=pads)


@st.composite
def layouts(draw: st.DrawFn, fmt: PagedFormat) -> KVLayout:
    return KVLayout(
        fmt,
        num_layers=draw(st.integers(1, 4)),
        # Packed formats copy whole blocks, which the torch connector finds for blocks of 2 tokens and more.
        block_size=draw(st.sampled_from([2, 4, 5, 8] if fmt.whole_blocks_only else [1, 2, 4, 5, 8])),
        num_kv_heads=1 if one_head(fmt) else draw(st.integers(1, 3)),
        head_dim=draw(st.sampled_from([1, 3, 8, 16])),
        dtype=draw(st.sampled_from(DTYPES)),
    )


@st.composite
def block_orders(draw: st.DrawFn, num_blocks: int) -> list[int]:
    """Distinct blocks: shuffled, consecutive (runs merge), or consecutive runs in shuffled order."""
    kind = draw(st.sampled_from(["shuffled", "consecutive", "runs"]))
    count = draw(st.integers(1, num_blocks))
    if kind == "shuffled":
        return list(draw(st.permutations(range(num_blocks))))[:count]
    if kind == "consecutive":
        start = draw(st.integers(0, num_blocks - count))
        return list(range(start, start + count))
    cuts = sorted(draw(st.sets(st.integers(1, num_blocks - 1), max_size=3))) if num_blocks > 1 else []
    runs = [list(range(a, b)) for a, b in zip([0, *cuts], [*cuts, num_blocks])]
    shuffled = draw(st.permutations(runs))
    return [block for run in shuffled for block in run][:count]


@st.composite
def slots_and_spans(draw: st.DrawFn, layout: KVLayout, num_blocks: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A slot tensor of distinct slots and the spans (chunks) of one engine call over it.

    Packed formats get whole blocks in order and spans on block boundaries; other formats
    also get any distinct slots, spans that start mid-block and partial last spans.
    """
    size = layout.block_size
    blocks = draw(block_orders(num_blocks))
    slots = (torch.tensor(blocks)[:, None] * size + torch.arange(size)).reshape(-1)
    step = size if layout.whole_blocks_only else 1
    if not layout.whole_blocks_only and draw(st.booleans()):
        total = num_blocks * size
        slots = torch.tensor(draw(st.permutations(range(total)))[: draw(st.integers(1, total))])
    units = slots.numel() // step
    first, last = 0, units
    if draw(st.booleans()):  # a call over part of the slots: from mid-tensor (mid-block), to before its end
        first = draw(st.integers(0, units - 1))
        last = draw(st.integers(first + 1, units))
    cuts = draw(st.sets(st.integers(first + 1, last - 1), max_size=3)) if last - first > 1 else set()
    points = [first, *sorted(cuts), last]
    return slots, [(a * step, b * step) for a, b in pairwise(points)]


def layer_ranges(num_layers: int) -> st.SearchStrategy[range]:
    return st.tuples(st.integers(0, num_layers - 1), st.integers(1, num_layers)).map(
        lambda ab: range(min(ab[0], ab[1] - 1), ab[1])
    )


@dataclass(frozen=True)
class ChunkStorage:
    """Where a chunk ``[L, kv, n, width]`` lives; every kind keeps token rows dense.

    ``dense``; ``sliced``: the tail of a longer chunk (a retrieve from mid-chunk);
    ``offset``: a view into a buffer ``skip`` elements in (not 16-byte aligned).
    """

    kind: str = "dense"
    skip: int = 1


chunk_storages = st.builds(ChunkStorage, kind=st.sampled_from(["dense", "sliced", "offset"]), skip=st.integers(1, 3))


def make_chunk(layout: KVLayout, num_tokens: int, storage: ChunkStorage, seed: int | None) -> torch.Tensor:
    """A chunk of random bytes (all :data:`UNWRITTEN` bytes for seed None); the same arguments give the same
    bytes in the same geometry."""
    if seed is None:
        chunk = make_chunk(layout, num_tokens, storage, 0)
        unwritten(chunk)
        return chunk
    generator = torch.Generator().manual_seed(seed)
    shape = layout.chunk_shape(num_tokens)
    if storage.kind == "sliced":
        longer = (*shape[:2], num_tokens + storage.skip, shape[3])
        return random_bytes(longer, layout.dtype, generator)[:, :, storage.skip :]
    if storage.kind == "offset":
        buffer = random_bytes((math.prod(shape) + storage.skip,), layout.dtype, generator)
        return buffer[storage.skip :].view(shape)
    return random_bytes(shape, layout.dtype, generator)


def unwritten(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` (and the whole allocation it views) with :data:`UNWRITTEN` bytes."""
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    storage.fill_(UNWRITTEN)
    return t


def written_bytes(t: torch.Tensor) -> int:
    """Bytes of the whole allocation ``t`` views that are not :data:`UNWRITTEN` (inside the view or not)."""
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return int((storage != UNWRITTEN).sum())


def torch_connector(layout: KVLayout) -> kvplug.TorchConnector:
    return kvplug.TorchConnector(kvplug.TorchConnector.Config(), layout)


def run_all(copies: Sequence[Callable[[], None]]) -> None:
    for copy in copies:
        copy()
