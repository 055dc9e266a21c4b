"""The ``native`` connector against the core's ``torch`` connector: the same bytes for every layout.

Gathers must give bit-for-bit the chunks the torch connector gives, and scatters must leave
every byte of the cache (padding between rows included) as the torch connector leaves it,
whatever the format, dtype, memory geometry of the cache, slot order, span boundaries,
layer range, number of parts and streaming setting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_helpers import (
    DTYPES,
    FLASH,
    FORMATS,
    HND,
    MLA,
    PACKED,
    PACKED_KV,
    SLOTS_KV,
    UNWRITTEN,
    Caches,
    ChunkStorage,
    Geometry,
    chunk_storages,
    dense_bytes,
    geometries,
    layer_ranges,
    layouts,
    make_caches,
    make_chunk,
    run_all,
    slots_and_spans,
    torch_connector,
    unwritten,
    written_bytes,
)

import kvplug
from kvplug import KVLayout, PagedFormat
from kvplug.errors import LayoutError
from kvplug.testing import gather_chunk, scatter_chunk
from kvplug_native import NativeConnector, NativeConnectorConfig, NativePlan


def native(layout: KVLayout, streaming_min_bytes: int | None = None) -> NativeConnector:
    return NativeConnector(NativeConnectorConfig(streaming_min_bytes=streaming_min_bytes), layout)


@dataclass
class Scenario:
    """One engine call: a layout, caches in some geometry, the call's slots and spans, and how it is copied."""

    layout: KVLayout
    caches: Caches
    slots: torch.Tensor
    spans: list[tuple[int, int]]
    layers: range
    parts: int
    streaming_min_bytes: int | None
    storages: list[ChunkStorage]
    seed: int
    elsewhere: bool  # the copies are asked for on a thread other than the main one (a background load)

    def chunks(self, *, fresh: bool) -> list[torch.Tensor]:
        """One chunk per span: unwritten bytes (``fresh``, for gathers) or random bytes (for scatters)."""
        return [
            make_chunk(self.layout, end - start, storage, None if fresh else self.seed + index)
            for index, ((start, end), storage) in enumerate(zip(self.spans, self.storages))
        ]


@st.composite
def scenarios(draw: st.DrawFn, fmt: PagedFormat) -> Scenario:
    layout = draw(layouts(fmt))
    num_blocks = draw(st.integers(2, 8))
    seed = draw(st.integers(0, 2**20))
    layer_geometries = draw(st.lists(geometries(fmt), min_size=layout.num_layers, max_size=layout.num_layers))
    caches = make_caches(layout, num_blocks, torch.Generator().manual_seed(seed), layer_geometries)
    slots, spans = draw(slots_and_spans(layout, num_blocks))
    layers = draw(st.one_of(st.just(range(layout.num_layers)), layer_ranges(layout.num_layers)))
    return Scenario(
        layout=layout,
        caches=caches,
        slots=slots,
        spans=spans,
        layers=layers,
        parts=draw(st.integers(1, 3)),
        streaming_min_bytes=draw(st.sampled_from([0, None])),
        storages=draw(st.lists(chunk_storages, min_size=len(spans), max_size=len(spans))),
        seed=seed,
        elsewhere=draw(st.booleans()),
    )


def on_thread(elsewhere: bool, ask: Callable[[], list[Callable[[], None]]]) -> list[Callable[[], None]]:
    """``ask()`` on this thread, or on a new one (where the connector shares the copies out differently)."""
    if not elsewhere:
        return ask()
    result: list[list[Callable[[], None]]] = []
    thread = threading.Thread(target=lambda: result.append(ask()))
    thread.start()
    thread.join()
    assert len(result) == 1, "asking for the copies failed on the other thread"
    return result[0]


def _layer_bytes(chunk: torch.Tensor, layers: range) -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of the chunk's layers in ``layers``, and of its other layers."""
    inside = torch.zeros(chunk.shape[0], dtype=torch.bool)
    inside[layers.start : layers.stop] = True
    return dense_bytes(chunk[inside]), dense_bytes(chunk[~inside])


FORMAT_IDS = [f.name.removeprefix("native_test_") for f in FORMATS]


# --- equivalence with the torch connector ----------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_gather_copies_give_the_torch_connectors_chunks(fmt: PagedFormat, data: st.DataObject) -> None:
    s = data.draw(scenarios(fmt))
    before = s.caches.clone()
    connector, reference = native(s.layout, s.streaming_min_bytes), torch_connector(s.layout)
    got, want = s.chunks(fresh=True), s.chunks(fresh=True)

    plans = connector.plan_many(s.slots, s.spans)
    run_all(on_thread(s.elsewhere, lambda: connector.gather_copies(s.caches.layers, s.layers, plans, got, s.parts)))
    run_all(reference.gather_copies(s.caches.layers, s.layers, reference.plan_many(s.slots, s.spans), want, s.parts))

    for mine, theirs in zip(got, want):
        assert torch.equal(dense_bytes(mine), dense_bytes(theirs))
        inside, outside = _layer_bytes(mine, s.layers)
        assert not bool((inside == UNWRITTEN).any()), "a byte of a gathered layer was not written"
        assert bool((outside == UNWRITTEN).all()), "a layer outside the call's range was written"
        assert written_bytes(mine) == inside.numel(), "a byte outside the chunk's view was written"
    assert s.caches.same_bytes(before), "a gather wrote into the cache"


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_scatter_copies_write_the_torch_connectors_bytes(fmt: PagedFormat, data: st.DataObject) -> None:
    s = data.draw(scenarios(fmt))
    target = s.caches.clone(fill=lambda base: unwritten(torch.empty_like(base)))
    mine, theirs = target.clone(), target.clone()
    connector, reference = native(s.layout, s.streaming_min_bytes), torch_connector(s.layout)
    sources = s.chunks(fresh=False)
    kept = [chunk.clone() for chunk in sources]

    plans = connector.plan_many(s.slots, s.spans)
    run_all(on_thread(s.elsewhere, lambda: connector.scatter_copies(mine.layers, s.layers, plans, sources, s.parts)))
    run_all(reference.scatter_copies(theirs.layers, s.layers, reference.plan_many(s.slots, s.spans), kept, s.parts))

    assert mine.same_bytes(theirs)
    assert not theirs.same_bytes(target)  # the call wrote something (random bytes are never UNWRITTEN)
    assert all(torch.equal(dense_bytes(a), dense_bytes(b)) for a, b in zip(sources, kept)), "a source was written"


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_chunk_methods_match_the_torch_connector(fmt: PagedFormat, dtype: torch.dtype) -> None:
    """``gather``/``scatter`` (all layers) and ``gather_layer``/``scatter_layer`` of one plan."""
    heads = 1 if fmt.latent or "head" not in fmt.axes else 2
    layout = KVLayout(fmt, num_layers=3, block_size=4, num_kv_heads=heads, head_dim=8, dtype=dtype)
    caches = make_caches(layout, 6, torch.Generator().manual_seed(3))
    slots = (torch.tensor([4, 1, 2])[:, None] * 4 + torch.arange(4)).flatten()  # blocks 1 and 2 merge
    connector, reference = native(layout, 0), torch_connector(layout)

    got = unwritten(torch.empty(layout.chunk_shape(12), dtype=dtype))
    want = unwritten(torch.empty_like(got))
    gather_chunk(connector, caches.layers, slots, got)
    gather_chunk(reference, caches.layers, slots, want)
    assert torch.equal(dense_bytes(got), dense_bytes(want))
    assert not bool((dense_bytes(got) == UNWRITTEN).any())

    layer_got, layer_want = unwritten(torch.empty_like(got[0])), unwritten(torch.empty_like(got[0]))
    connector.gather_layer(caches.layers[2], connector.plan(slots), layer_got)
    reference.gather_layer(caches.layers[2], reference.plan(slots), layer_want)
    assert torch.equal(dense_bytes(layer_got), dense_bytes(layer_want))
    assert torch.equal(dense_bytes(layer_got), dense_bytes(got[2]))

    mine, theirs = caches.clone(), caches.clone()
    source = make_chunk(layout, 12, ChunkStorage(), seed=11)
    other = (torch.tensor([0, 5, 3])[:, None] * 4 + torch.arange(4)).flatten()
    scatter_chunk(connector, mine.layers, other, source)
    scatter_chunk(reference, theirs.layers, other, source)
    assert mine.same_bytes(theirs) and not mine.same_bytes(caches)
    connector.scatter_layer(mine.layers[1], connector.plan(slots), source[0])
    reference.scatter_layer(theirs.layers[1], reference.plan(slots), source[0])
    assert mine.same_bytes(theirs)


def test_plans_of_a_call_are_native_plans_of_their_spans() -> None:
    layout = KVLayout(FLASH, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    connector = native(layout)
    slots = torch.arange(40, dtype=torch.int32)
    plans = connector.plan_many(slots, [(0, 16), (16, 30), (30, 30)])
    assert all(isinstance(plan, NativePlan) for plan in plans)
    assert [plan.num_slots for plan in plans] == [16, 14, 0]
    assert connector.plan(slots).num_slots == 40
    assert torch.equal(plans[1].torch_plan.slots, torch.arange(16, 30))


def test_chunks_of_two_calls_in_one_batch() -> None:
    """Plans from two ``plan_many`` calls copied together (an engine may batch requests)."""
    layout = KVLayout(HND, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    caches = make_caches(layout, 8, torch.Generator().manual_seed(5))
    connector, reference = native(layout, 0), torch_connector(layout)
    first, second = torch.arange(8, 20), torch.tensor([31, 30, 29, 0, 1, 2, 3])
    plans = [*connector.plan_many(first, [(0, 5), (5, 12)]), *connector.plan_many(second, [(1, 7)])]
    ref_plans = [*reference.plan_many(first, [(0, 5), (5, 12)]), *reference.plan_many(second, [(1, 7)])]
    got = [unwritten(torch.empty(layout.chunk_shape(n), dtype=layout.dtype)) for n in (5, 7, 6)]
    want = [chunk.clone() for chunk in got]
    run_all(connector.gather_copies(caches.layers, range(3), plans, got, 2))
    run_all(reference.gather_copies(caches.layers, range(3), ref_plans, want, 2))
    for mine, theirs in zip(got, want):
        assert torch.equal(dense_bytes(mine), dense_bytes(theirs))
        assert not bool((dense_bytes(mine) == UNWRITTEN).any())


def test_a_subset_of_a_calls_chunks() -> None:
    """Copies of some of a call's plans (a retrieve that stops at a miss) copy those chunks only."""
    layout = KVLayout(PACKED, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    caches = make_caches(layout, 8, torch.Generator().manual_seed(6))
    connector, reference = native(layout), torch_connector(layout)
    slots = (torch.tensor([6, 2, 3, 0])[:, None] * 4 + torch.arange(4)).flatten()
    plans = connector.plan_many(slots, [(0, 4), (4, 12), (12, 16)])
    ref_plans = reference.plan_many(slots, [(0, 4), (4, 12), (12, 16)])
    mine, theirs = caches.clone(), caches.clone()
    sources = [make_chunk(layout, 4, ChunkStorage(), 1), make_chunk(layout, 4, ChunkStorage(), 2)]
    run_all(connector.scatter_copies(mine.layers, range(2), [plans[2], plans[0]], sources, 1))
    run_all(reference.scatter_copies(theirs.layers, range(2), [ref_plans[2], ref_plans[0]], sources, 1))
    assert mine.same_bytes(theirs) and not mine.same_bytes(caches)
    for layer in range(2):  # blocks 2 and 3 (the middle plan) are untouched
        assert torch.equal(dense_bytes(mine.layers[layer][2:4]), dense_bytes(caches.layers[layer][2:4]))


# --- unaligned destinations, streaming -----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset_elements", [1, 3])
def test_unaligned_destinations_with_streaming_stores(dtype: torch.dtype, offset_elements: int) -> None:
    """Chunks and caches at addresses that are element aligned but not 16-byte aligned, streamed."""
    layout = KVLayout(FLASH, num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype=dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    connector, reference = native(layout, 0), torch_connector(layout)
    caches = make_caches(layout, 8, torch.Generator().manual_seed(1))
    slots = (torch.tensor([7, 1, 2, 3, 5])[:, None] * 16 + torch.arange(16)).flatten()[3:-5]
    shape = layout.chunk_shape(slots.numel())
    count = shape[0] * shape[1] * shape[2] * shape[3]
    buffer = unwritten(torch.empty((count + offset_elements) * itemsize, dtype=torch.uint8))
    got = buffer[offset_elements * itemsize :].view(dtype).view(shape)
    assert got.data_ptr() % 16 != 0
    want = unwritten(torch.empty(shape, dtype=dtype))

    gather_chunk(connector, caches.layers, slots, got)
    gather_chunk(reference, caches.layers, slots, want)
    assert torch.equal(dense_bytes(got), dense_bytes(want))
    assert bool((buffer[: offset_elements * itemsize] == UNWRITTEN).all())

    # Scatter into a cache that itself starts off a 16-byte boundary.
    cache_bytes = layout.num_layers * 2 * 8 * 16 * 4 * 64 * itemsize
    raw = unwritten(torch.empty(cache_bytes + offset_elements * itemsize, dtype=torch.uint8))
    flat = raw[offset_elements * itemsize :].view(dtype)
    target = list(flat.view(layout.num_layers, 2, 8, 16, 4, 64).unbind(0))
    expected = [unwritten(torch.empty_like(t)) for t in target]
    other = torch.arange(16, 16 + slots.numel())
    scatter_chunk(connector, target, other, got)
    scatter_chunk(reference, expected, other, want)
    assert all(torch.equal(dense_bytes(a), dense_bytes(b)) for a, b in zip(target, expected))
    assert bool((raw[: offset_elements * itemsize] == UNWRITTEN).all())


def test_streaming_follows_the_threshold() -> None:
    """Streaming stores from ``streaming_min_bytes`` bytes of a call on (>=), never with None; copies' sharing."""
    layout = KVLayout(FLASH, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    caches = make_caches(layout, 4, torch.Generator().manual_seed(0))
    slots = torch.arange(8)
    total = 2 * 2 * 8 * 2 * 8 * 2  # layers * kv * tokens * width * itemsize
    chunk = torch.empty(layout.chunk_shape(8), dtype=layout.dtype)

    def streams(minimum: int | None, parts: int = 1) -> bool:
        connector = native(layout, minimum)
        copies = connector.gather_copies(caches.layers, range(2), [connector.plan(slots)], [chunk], parts)
        # On the main thread: one C call, shared out among the thread's OpenMP team of ``parts``.
        assert len(copies) == 1
        assert copies[0].threads == parts
        # Elsewhere: the same table in at most ``parts`` shares of one thread each (the engine's copy threads).
        shares = on_thread(
            True, lambda: connector.gather_copies(caches.layers, range(2), [connector.plan(slots)], [chunk], parts)
        )
        assert 1 <= len(shares) <= parts and all(share.threads == 1 for share in shares)
        assert torch.equal(torch.cat([share.table for share in shares]), copies[0].table)
        assert all(share.streaming == copies[0].streaming for share in shares)
        return bool(copies[0].streaming)

    assert streams(0) and streams(total) and streams(total, parts=3)
    assert not streams(total + 1) and not streams(total + 1, parts=2)
    assert not streams(None)
    default = NativeConnector(NativeConnectorConfig(), layout)
    assert default.options.streaming_min_bytes == 8 * 2**20
    assert NativeConnectorConfig.model_validate({"streaming_min_bytes": "1KiB"}).streaming_min_bytes == 1024


# --- out-of-range input --------------------------------------------------------------------


def _expect_layout_error(
    layout: KVLayout, caches: Caches, slots: torch.Tensor, spans: list[tuple[int, int]], match: str
) -> None:
    """gather_copies and scatter_copies raise LayoutError (when built or run) and write nothing."""
    connector = native(layout, 0)
    before = caches.clone()
    chunks = [unwritten(torch.empty(layout.chunk_shape(end - start), dtype=layout.dtype)) for start, end in spans]
    with pytest.raises(LayoutError, match=match):
        run_all(
            connector.gather_copies(
                caches.layers, range(layout.num_layers), connector.plan_many(slots, spans), chunks, 2
            )
        )
    assert all(bool((dense_bytes(chunk) == UNWRITTEN).all()) for chunk in chunks), "a gather wrote a chunk"
    sources = [make_chunk(layout, end - start, ChunkStorage(), index) for index, (start, end) in enumerate(spans)]
    with pytest.raises(LayoutError, match=match):
        run_all(
            connector.scatter_copies(
                caches.layers, range(layout.num_layers), connector.plan_many(slots, spans), sources, 2
            )
        )
    assert caches.same_bytes(before), "a scatter that raised wrote into the cache"


@pytest.mark.parametrize("fmt", [FLASH, HND, MLA, SLOTS_KV], ids=["flash", "hnd", "mla", "slots_kv"])
@pytest.mark.parametrize("bad", [48, 1000, -1, -17])
def test_a_slot_outside_the_cache_is_a_layout_error(fmt: PagedFormat, bad: int) -> None:
    heads = 1 if fmt.latent else 2
    layout = KVLayout(fmt, num_layers=2, block_size=4, num_kv_heads=heads, head_dim=8, dtype=torch.bfloat16)
    caches = make_caches(layout, 12, torch.Generator().manual_seed(0))  # 48 slots
    slots = torch.tensor([0, 1, 2, 3, 9, 10, bad, 47])
    _expect_layout_error(layout, caches, slots, [(0, 4), (4, 8)], match=rf"slot {bad}\b.*outside the cache")


@pytest.mark.parametrize("fmt", [PACKED, PACKED_KV], ids=["packed", "packed_kv"])
@pytest.mark.parametrize("bad_block", [6, 9, -1])
def test_a_block_outside_a_packed_cache_is_a_layout_error(fmt: PagedFormat, bad_block: int) -> None:
    layout = KVLayout(fmt, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    caches = make_caches(layout, 6, torch.Generator().manual_seed(0))
    slots = (torch.tensor([1, 2, bad_block])[:, None] * 4 + torch.arange(4)).flatten()
    _expect_layout_error(layout, caches, slots, [(0, 4), (4, 12)], match=rf"block {bad_block}\b.*outside the cache")


@pytest.mark.parametrize("fmt", [PACKED, PACKED_KV], ids=["packed", "packed_kv"])
@pytest.mark.parametrize(
    "slots, spans",
    [
        (torch.arange(4, 16), [(0, 4), (4, 10)]),  # a partial last block
        (torch.arange(4, 16), [(2, 6)]),  # a span from mid-block
        (torch.tensor([4, 5, 7, 6, 8, 9, 10, 11]), [(0, 8)]),  # a block's slots out of order
        (torch.arange(2, 10), [(0, 8)]),  # slots that straddle two blocks
    ],
)
def test_a_span_that_is_not_whole_blocks_of_a_packed_cache_is_a_layout_error(
    fmt: PagedFormat, slots: torch.Tensor, spans: list[tuple[int, int]]
) -> None:
    layout = KVLayout(fmt, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    caches = make_caches(layout, 6, torch.Generator().manual_seed(0))
    _expect_layout_error(layout, caches, slots, spans, match="whole blocks")


# --- fallbacks to the torch connector ------------------------------------------------------


def _copies_go_to_the_torch_connector(copies: list) -> bool:
    """Whether every copy is a bound method call of a torch connector (the native connector's fallback)."""
    owners = [getattr(getattr(copy, "func", None), "__self__", None) for copy in copies]
    return bool(owners) and all(isinstance(owner, kvplug.TorchConnector) for owner in owners)


@pytest.mark.parametrize("fmt", [FLASH, HND, MLA, PACKED, SLOTS_KV], ids=["flash", "hnd", "mla", "packed", "slots_kv"])
def test_a_chunk_without_dense_token_rows_is_copied_exactly(fmt: PagedFormat) -> None:
    """``[L, kv, n, width]`` views whose rows are not dense (transposed, strided) go to the torch connector.

    (The torch connector gathers a packed format into dense chunks only: packed formats are scattered here.)
    """
    heads = 1 if fmt.latent else 2
    layout = KVLayout(fmt, num_layers=2, block_size=4, num_kv_heads=heads, head_dim=8, dtype=torch.bfloat16)
    caches = make_caches(layout, 6, torch.Generator().manual_seed(2))
    slots = (torch.tensor([5, 0, 1])[:, None] * 4 + torch.arange(4)).flatten()
    connector, reference = native(layout, 0), torch_connector(layout)
    L, kv, n, width = layout.chunk_shape(12)
    views = {
        "transposed": lambda: unwritten(torch.empty(L, n, kv, width, dtype=layout.dtype)).transpose(1, 2),
        "every other element": lambda: unwritten(torch.empty(L, kv, n, 2 * width, dtype=layout.dtype))[..., ::2],
    }
    if kv == 1:  # transposing a size-1 axis leaves a latent chunk contiguous
        del views["transposed"]
    for make in views.values():
        got, want = make(), make()
        assert got.shape == (L, kv, n, width) and not got.is_contiguous()
        assert _copies_go_to_the_torch_connector(
            connector.gather_copies(caches.layers, range(L), [connector.plan(slots)], [got], 1)
        )
        if not fmt.whole_blocks_only:
            gather_chunk(connector, caches.layers, slots, got)
            gather_chunk(reference, caches.layers, slots, want)
            assert torch.equal(dense_bytes(got), dense_bytes(want))
            assert not bool((dense_bytes(got) == UNWRITTEN).any())

        mine, theirs = caches.clone(), caches.clone()
        source = make()
        source.copy_(make_chunk(layout, 12, ChunkStorage(), 4))
        other = (torch.tensor([2, 3, 4])[:, None] * 4 + torch.arange(4)).flatten()
        scatter_chunk(connector, mine.layers, other, source)
        scatter_chunk(reference, theirs.layers, other, source)
        assert mine.same_bytes(theirs) and not mine.same_bytes(caches)


@pytest.mark.parametrize("chunk_dtype", [torch.float32, torch.float16])
def test_a_chunk_of_another_dtype_is_refused_before_any_copy(chunk_dtype: torch.dtype) -> None:
    """A chunk whose dtype is not the cache's is never copied by bytes by a run table: it goes to the
    torch connector, which refuses it by name when asked for the copies (a chunk holds the cache's bytes as
    they are)."""
    layout = KVLayout(FLASH, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(8)
    caches = [torch.randn(2, 6, 4, 2, 8, generator=generator).to(torch.bfloat16) for _ in range(2)]
    before = [cache.clone() for cache in caches]
    slots = torch.tensor([20, 21, 22, 23, 4, 5, 6])
    connector, reference = native(layout, 0), torch_connector(layout)
    refused = f"layer 0: a chunk of {chunk_dtype} cannot be copied to or from a {layout.dtype} KV cache"

    got = torch.zeros(layout.chunk_shape(7), dtype=chunk_dtype)
    with pytest.raises(LayoutError, match=refused):
        connector.gather_copies(caches, range(2), [connector.plan(slots)], [got], 1)
    with pytest.raises(LayoutError, match=refused):
        reference.gather_copies(caches, range(2), [reference.plan(slots)], [got], 1)
    with pytest.raises(LayoutError, match=f"a chunk of {chunk_dtype} cannot be copied"):
        gather_chunk(reference, caches, slots, torch.zeros_like(got))
    assert not bool(got.any())
    same_dtype = torch.zeros(layout.chunk_shape(7), dtype=layout.dtype)
    assert not _copies_go_to_the_torch_connector(
        connector.gather_copies(caches, range(2), [connector.plan(slots)], [same_dtype], 1)
    )

    source = torch.randn(layout.chunk_shape(7), generator=generator).to(chunk_dtype)
    with pytest.raises(LayoutError, match=refused):
        connector.scatter_copies(caches, range(2), [connector.plan(slots)], [source], 1)
    with pytest.raises(LayoutError, match=f"a chunk of {chunk_dtype} cannot be copied"):
        scatter_chunk(connector, caches, slots, source)
    assert all(torch.equal(a, b) for a, b in zip(caches, before)), "a refused scatter wrote into the cache"


def test_a_cache_whose_head_dim_is_not_contiguous_is_copied_exactly() -> None:
    """A flash-format cache tensor whose ``dim`` axis is strided (a view of a transposed allocation)."""
    layout = KVLayout(FLASH, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    geometry = Geometry(order=(0, 1, 2, 4, 3))  # memory order kv, block, token, dim, head
    caches = make_caches(layout, 5, torch.Generator().manual_seed(9), [geometry, Geometry()])
    assert caches.layers[0].stride(-1) != 1
    slots = torch.tensor([19, 3, 4, 5, 6, 7, 8, 0])
    connector, reference = native(layout, 0), torch_connector(layout)
    got, want = [unwritten(torch.empty(layout.chunk_shape(8), dtype=layout.dtype)) for _ in range(2)]
    copies = connector.gather_copies(caches.layers, range(2), [connector.plan(slots)], [got], 1)
    assert _copies_go_to_the_torch_connector(copies)
    run_all(copies)
    gather_chunk(reference, caches.layers, slots, want)
    assert torch.equal(dense_bytes(got), dense_bytes(want))
    mine, theirs = caches.clone(), caches.clone()
    scatter_chunk(connector, mine.layers, slots.flip(0), got)
    scatter_chunk(reference, theirs.layers, slots.flip(0), want)
    assert mine.same_bytes(theirs) and not mine.same_bytes(caches)


def test_a_cache_off_the_cpu_goes_to_the_torch_connector() -> None:
    """A cache on another device (``meta`` stands in for a GPU here) is never addressed by a run table."""
    layout = KVLayout(FLASH, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    caches = [torch.empty(2, 4, 4, 2, 8, dtype=torch.bfloat16, device="meta") for _ in range(2)]
    connector = native(layout, 0)
    plans = connector.plan_many(torch.arange(12), [(0, 8), (8, 12)])
    chunks = [torch.empty(layout.chunk_shape(n), dtype=layout.dtype) for n in (8, 4)]
    # Not run: the torch connector cannot copy between meta and the CPU. Only where the copies go is checked.
    assert _copies_go_to_the_torch_connector(connector.gather_copies(caches, range(2), plans, chunks, 2))
    assert _copies_go_to_the_torch_connector(connector.scatter_copies(caches, range(2), plans, chunks, 2))


# --- thread safety -------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [FLASH, PACKED_KV], ids=["flash", "packed_kv"])
def test_two_threads_copy_disjoint_chunks_on_one_connector(fmt: PagedFormat) -> None:
    layout = KVLayout(fmt, num_layers=4, block_size=8, num_kv_heads=4, head_dim=32, dtype=torch.bfloat16)
    caches = make_caches(layout, 32, torch.Generator().manual_seed(12))
    connector, reference = native(layout, 0), torch_connector(layout)
    order = torch.randperm(32, generator=torch.Generator().manual_seed(13))
    block_sets = [order[:16], order[16:]]
    slot_sets = [(blocks[:, None] * 8 + torch.arange(8)).flatten() for blocks in block_sets]
    spans = [(0, 32), (32, 64), (64, 128)]
    targets = caches.clone(fill=lambda base: unwritten(torch.empty_like(base)))
    expected = targets.clone()
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(index: int) -> None:
        try:
            start.wait()
            for _ in range(10):
                plans = connector.plan_many(slot_sets[index], spans)
                chunks = [torch.empty(layout.chunk_shape(end - begin), dtype=layout.dtype) for begin, end in spans]
                run_all(connector.gather_copies(caches.layers, range(4), plans, chunks, 2))
                run_all(connector.scatter_copies(targets.layers, range(4), plans, chunks, 2))
            results[index] = chunks
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for index in range(2):
        plans = reference.plan_many(slot_sets[index], spans)
        want = [torch.empty(layout.chunk_shape(end - begin), dtype=layout.dtype) for begin, end in spans]
        run_all(reference.gather_copies(caches.layers, range(4), plans, want, 1))
        run_all(reference.scatter_copies(expected.layers, range(4), plans, want, 1))
        assert all(torch.equal(dense_bytes(a), dense_bytes(b)) for a, b in zip(results[index], want))
    assert targets.same_bytes(expected)
    assert targets.same_bytes(caches)  # every block of the cache was copied over by one thread


# --- registration --------------------------------------------------------------------------


def test_the_connector_is_registered_as_native() -> None:
    registry = kvplug.PluginRegistry()
    connectors = registry.kv_connectors()
    assert connectors["native"] is NativeConnector
    assert NativeConnector.is_available()
    assert NativeConnector.concurrent_copies
    assert NativeConnector.priority > getattr(connectors["torch"], "priority", 0)


# --- bugs found while writing this suite (these tests fail until the plugin is fixed) ----------


def test_a_slot_outside_a_smaller_v_tensor_is_a_layout_error() -> None:
    """K and V tensors of one layer with different slot counts: slots are checked against every tensor
    (a slot that fits K but not V would be a run outside V: here into the buffer V is a view of)."""
    layout = KVLayout(SLOTS_KV, num_layers=1, block_size=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    keys = torch.zeros(8, 1, 4)
    buffer = torch.zeros(16, 1, 4)
    values = buffer[:4]  # 4 slots where K has 8
    source = torch.ones(layout.chunk_shape(1))
    with pytest.raises(LayoutError, match=r"slot 6\b"):
        scatter_chunk(native(layout), [(keys, values)], torch.tensor([6]), source)
    assert not bool(buffer.any()), "a scatter wrote outside the V tensor"
    with pytest.raises((LayoutError, IndexError)):
        scatter_chunk(torch_connector(layout), [(keys, values)], torch.tensor([6]), source)


def test_one_plan_gathered_into_two_chunks() -> None:
    """``plans[i]`` goes with ``chunks[i]``: the same plan twice gathers into both chunks, as the torch connector does
    (a run table has one chunk address per span, so a repeated span needs a table of its own)."""
    layout = KVLayout(FLASH, num_layers=1, block_size=4, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    caches = make_caches(layout, 4, torch.Generator().manual_seed(0))
    connector, reference = native(layout), torch_connector(layout)
    plan, ref_plan = connector.plan(torch.arange(4)), reference.plan(torch.arange(4))
    got = [unwritten(torch.empty(layout.chunk_shape(4))) for _ in range(2)]
    want = [unwritten(torch.empty(layout.chunk_shape(4))) for _ in range(2)]
    run_all(connector.gather_copies(caches.layers, range(1), [plan, plan], got, 1))
    run_all(reference.gather_copies(caches.layers, range(1), [ref_plan, ref_plan], want, 1))
    assert torch.equal(dense_bytes(got[1]), dense_bytes(want[1]))
    assert torch.equal(dense_bytes(got[0]), dense_bytes(want[0])), "the first chunk of a repeated plan was not written"


def test_plans_of_two_calls_interleaved() -> None:
    """Plans of two ``plan_many`` calls, taken in turns: every chunk gets its own call's span, as with the torch
    connector (grouping plans by call once put a span of the first call into the second call's group)."""
    layout = KVLayout(FLASH, num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    caches = make_caches(layout, 8, torch.Generator().manual_seed(0))
    connector, reference = native(layout), torch_connector(layout)
    slots_a, slots_b = torch.arange(8), torch.arange(31, 23, -1)
    spans = [(0, 4), (4, 8)]
    first, second = connector.plan_many(slots_a, spans), connector.plan_many(slots_b, spans)
    ref_first, ref_second = reference.plan_many(slots_a, spans), reference.plan_many(slots_b, spans)
    plans = [first[0], second[0], first[1], second[1]]
    ref_plans = [ref_first[0], ref_second[0], ref_first[1], ref_second[1]]
    got = [unwritten(torch.empty(layout.chunk_shape(4))) for _ in plans]
    want = [unwritten(torch.empty(layout.chunk_shape(4))) for _ in plans]
    run_all(connector.gather_copies(caches.layers, range(2), plans, got, 1))
    run_all(reference.gather_copies(caches.layers, range(2), ref_plans, want, 1))
    for index, (mine, theirs) in enumerate(zip(got, want)):
        assert torch.equal(dense_bytes(mine), dense_bytes(theirs)), f"chunk {index} holds another span's KV"
