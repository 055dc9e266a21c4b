"""The native connector refuses chunks and layers that do not fit each other before any copy.

A run table is addresses and byte counts that the C copy trusts: a layer whose dtype is
not the chunk's once gave runs of its own element size into a chunk of another, past
the chunk's end. Chunks live in one segment here, between neighbours, as frames do in
a shared segment of the frame pool: a refused gather leaves every byte of the segment
as it was, a refused scatter every byte of the cache.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
import torch
from native_helpers import FORMATS, dense_bytes, make_caches, random_bytes, run_all, unwritten

from kvplug import KVLayout, PagedFormat, TorchConnector
from kvplug.errors import LayoutError
from kvplug.testing import gather_chunk, scatter_chunk
from kvplug_native import NativeConnector, NativeConnectorConfig

FORMAT_IDS = [f.name.removeprefix("native_test_") for f in FORMATS]
#: Two chunks of one call: whole blocks 5 and 0, then 1 and 3 (packed formats copy whole blocks only).
SLOTS = (torch.tensor([5, 0, 1, 3])[:, None] * 4 + torch.arange(4)).flatten()
SPANS = [(0, 8), (8, 16)]
#: Bytes of the segment before, between and after the chunks: far more than a bad run table once wrote past one.
NEIGHBOURS = 64 * 1024


def layout_of(fmt: PagedFormat) -> KVLayout:
    heads = 1 if fmt.latent or "head" not in fmt.axes else 2
    return KVLayout(fmt, num_layers=3, block_size=4, num_kv_heads=heads, head_dim=8, dtype=torch.float16)


def shaped(*shape: int, dtype: torch.dtype = torch.float16) -> Callable[[torch.Tensor], torch.Tensor]:
    """A maker of a chunk of ``shape``: a view of the start of the memory it is given (fp16: the layouts' dtype)."""
    return lambda memory: memory[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def bad_chunks(layout: KVLayout, tokens: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Chunks a plan of ``tokens`` slots over every layer must refuse, as makers of views of memory."""
    layers, kv, _, width = layout.chunk_shape(tokens)
    strided = shaped(layers, kv, tokens - 4, 2 * width)
    return {
        "fewer_tokens": shaped(layers, kv, tokens - 4, width),
        "more_tokens": shaped(layers, kv, tokens + 4, width),
        "3d": shaped(kv, tokens, width),  # one layer's chunk, without the layer axis
        "5d": shaped(layers, kv, tokens, 1, width),
        "fewer_layers": shaped(layers - 1, kv, tokens, width),
        "narrower": shaped(layers, kv, tokens, width // 2),
        "strided_fewer_tokens": lambda memory: strided(memory)[..., ::2],  # not contiguous and too small
        "other_dtype": shaped(layers, kv, tokens, width, dtype=torch.float32),
    }


#: Every bad chunk through every entry point (one layer of a chunk has no layer axis to lack).
CASES_AND_APIS = [
    (case, api)
    for case in bad_chunks(layout_of(FORMATS[0]), 8)
    for api in ("copies", "whole", "layer")
    if (case, api) != ("fewer_layers", "layer")
]


def in_segment(makers: list[Callable[[torch.Tensor], torch.Tensor]], fill: str) -> tuple[torch.Tensor, list]:
    """Chunks one after the other between neighbours in one segment of bytes: unwritten, or random bytes."""
    segment = torch.empty((len(makers) + 1) * NEIGHBOURS, dtype=torch.uint8)
    if fill == "unwritten":
        unwritten(segment)
    else:
        segment.copy_(random_bytes(segment.shape, torch.uint8, torch.Generator().manual_seed(7)))
    # Every chunk here is smaller than NEIGHBOURS: chunk i starts at NEIGHBOURS * i + NEIGHBOURS // 2.
    chunks = [make(segment[NEIGHBOURS * i + NEIGHBOURS // 2 :]) for i, make in enumerate(makers)]
    return segment, chunks


def copy_with(connector: NativeConnector, api: str, direction: str, layers: list, chunks: list) -> None:
    """``copies``: the two chunks of one call (the second one bad); ``whole``: kvplug.testing.gather_chunk/scatter_chunk of one chunk of
    all 16 slots; ``layer``: gather_layer/scatter_layer of the last layer."""
    if api == "copies":
        ask = connector.gather_copies if direction == "gather" else connector.scatter_copies
        run_all(ask(layers, range(len(layers)), connector.plan_many(SLOTS, SPANS), chunks, 2))
    elif api == "whole":
        (gather_chunk if direction == "gather" else scatter_chunk)(connector, layers, SLOTS, chunks[0])
    else:
        copy_layer = connector.gather_layer if direction == "gather" else connector.scatter_layer
        copy_layer(layers[-1], connector.plan(SLOTS), chunks[0][-1])


def attempt(call: Callable[[], None]) -> LayoutError | None:
    try:
        call()
    except LayoutError as exc:
        return exc
    return None


def outside_bytes_written(segment: torch.Tensor, kept: torch.Tensor, chunks: list[torch.Tensor]) -> int:
    """Bytes of the segment outside every chunk's view (from its first byte to its last) that the call changed."""
    outside = torch.ones_like(segment, dtype=torch.bool)
    for chunk in chunks:
        start = chunk.data_ptr() - segment.data_ptr()
        last = sum((size - 1) * stride for size, stride in zip(chunk.shape, chunk.stride()))
        outside[start : start + (last + 1) * chunk.element_size()] = False
    return int(((segment != kept) & outside).sum())


def layer_bytes(layers: list) -> list[torch.Tensor]:
    """A copy of the bytes of every tensor of ``layers``."""
    return [dense_bytes(t).clone() for layer in layers for t in (layer if isinstance(layer, tuple) else (layer,))]


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("case, api", CASES_AND_APIS)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_a_chunk_that_does_not_fit_its_plan_is_refused_before_any_copy(
    fmt: PagedFormat, case: str, api: str, direction: str
) -> None:
    """Too few or too many tokens, another rank, fewer layers, narrower rows, strided and too small, another
    dtype: a LayoutError naming the shape expected and the one given (or both dtypes), and nothing copied."""
    layout = layout_of(fmt)
    caches = make_caches(layout, 6, torch.Generator().manual_seed(1))
    before = caches.clone()
    tokens = 8 if api == "copies" else 16
    bad = bad_chunks(layout, tokens)[case]
    makers = [shaped(*layout.chunk_shape(8)), bad] if api == "copies" else [bad]  # a good chunk, then the bad one
    segment, chunks = in_segment(makers, "unwritten" if direction == "gather" else "random")
    kept = segment.clone()

    error = attempt(lambda: copy_with(native(layout), api, direction, caches.layers, chunks))

    written = outside_bytes_written(segment, kept, chunks)
    assert written == 0, f"the call wrote {written} bytes past its chunks, over their neighbours"
    assert torch.equal(segment, kept), "a refused call wrote into its chunks"
    assert caches.same_bytes(before), "a refused call wrote into the cache"
    assert error is not None, "the chunk was not refused"
    bad_chunk = chunks[-1] if api != "layer" else chunks[-1][-1].unsqueeze(0)
    layers, kv, _, width = layout.chunk_shape(tokens)
    if case == "other_dtype":
        expected = f"a chunk of {torch.float32} cannot be copied to or from a {layout.dtype} KV cache"
    else:
        expected = f"must be shaped [>= {1 if api == 'layer' else layers}, {kv}, {tokens}, {width}]"
    assert expected in str(error)
    assert case == "other_dtype" or f"got {list(bad_chunk.shape)}" in str(error)


def native(layout: KVLayout) -> NativeConnector:
    return NativeConnector(NativeConnectorConfig(streaming_min_bytes=0), layout)


def mixed_layers(layout: KVLayout, odd_dtype: torch.dtype) -> list:
    """Random caches of ``layout`` whose last layer holds ``odd_dtype`` (its V tensor only, when K and V are two)."""
    layers = list(make_caches(layout, 6, torch.Generator().manual_seed(2)).layers)
    last = layers[-1]
    generator = torch.Generator().manual_seed(3)
    odd = lambda t: random_bytes(t.shape, odd_dtype, generator)  # noqa: E731
    layers[-1] = (last[0], odd(last[1])) if isinstance(last, tuple) else odd(last)
    return layers


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("api", ["copies", "whole"])
@pytest.mark.parametrize("odd_dtype", [torch.float32, torch.float64, torch.uint8], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_a_layer_of_another_dtype_than_the_chunk_is_refused_by_name(
    fmt: PagedFormat, odd_dtype: torch.dtype, api: str, direction: str
) -> None:
    """Layers 0 and 1 hold the chunk's dtype (fp16), layer 2 another: its runs would be counted in its own
    element size, past the end of each chunk row. Refused naming the layer and both dtypes; nothing copied."""
    layout = layout_of(fmt)
    layers = mixed_layers(layout, odd_dtype)
    before = layer_bytes(layers)
    shapes = [layout.chunk_shape(end - start) for start, end in SPANS] if api == "copies" else [layout.chunk_shape(16)]
    makers = [shaped(*shape) for shape in shapes]
    segment, chunks = in_segment(makers, "unwritten" if direction == "gather" else "random")
    kept = segment.clone()

    error = attempt(lambda: copy_with(native(layout), api, direction, layers, chunks))

    written = outside_bytes_written(segment, kept, chunks)
    assert written == 0, f"the call wrote {written} bytes past its chunks, over their neighbours"
    assert torch.equal(segment, kept), "a refused call wrote into its chunks"
    assert all(torch.equal(a, b) for a, b in zip(layer_bytes(layers), before)), "a refused call wrote into the cache"
    assert error is not None, "the layer of another dtype was not refused"
    message = f"layer 2: a chunk of {layout.dtype} cannot be copied to or from a {odd_dtype} KV cache"
    assert re.search(re.escape(message), str(error))


def test_a_layer_off_the_cpu_sends_the_call_to_the_torch_connector() -> None:
    """Layer 0 in host memory, layer 1 elsewhere (``meta`` stands in for a GPU): a run table holds host addresses
    only, so the whole call goes to the torch connector. Not run: torch cannot copy between meta and the CPU."""
    layout = layout_of(FORMATS[0])
    layers = list(make_caches(layout, 6, torch.Generator().manual_seed(5)).layers)
    layers[1] = torch.empty_like(layers[1], device="meta")
    connector = native(layout)
    chunks = [torch.empty(layout.chunk_shape(end - start), dtype=layout.dtype) for start, end in SPANS]
    for ask in (connector.gather_copies, connector.scatter_copies):
        copies = ask(layers, range(3), connector.plan_many(SLOTS, SPANS), chunks, 2)
        owners = [getattr(getattr(copy, "func", None), "__self__", None) for copy in copies]
        assert owners and all(isinstance(owner, TorchConnector) for owner in owners)
