"""The torch connector refuses a chunk that does not fit its plan, or a layer of another dtype, before any copy.

The chunk lives in a segment with neighbours before and after it, as a frame does in a
shared segment of the frame pool: a refused gather must leave every byte of the segment
as it was (torch would resize an ``out=`` view too small for the plan inside its storage,
over the neighbours), and a refused scatter must leave the cache as it was.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from core_helpers import LAYOUTS, caches_equal, clone_caches, random_caches

from kvplug import KVLayout
from kvplug.builtins.torch_connector import TorchConnector
from kvplug.core.components import EmptyConfig
from kvplug.errors import LayoutError
from kvplug.testing import gather_chunk, scatter_chunk

NUM_BLOCKS = 48
#: The byte a gather's segment holds before the call; randn values in the caches are never all of it.
UNWRITTEN = 0xFF
#: Bytes of neighbours before and after the chunk in its segment.
NEIGHBOURS = 4096


def slots_for(layout: KVLayout) -> torch.Tensor:
    """16 slots: four whole blocks of 4 out of order (packed formats copy whole blocks only)."""
    size = layout.block_size
    if size == 1:
        return torch.tensor([9, 3, 4, 5, 40, 41, 42, 43, 12, 13, 14, 15, 30, 29, 28, 0])
    return (torch.tensor([7, 1, 2, 10])[:, None] * size + torch.arange(size)).flatten()


def bad_shapes(layout: KVLayout, tokens: int) -> dict[str, tuple[int, ...]]:
    """Chunk shapes a plan of ``tokens`` slots over every layer must refuse."""
    layers, kv, _, width = layout.chunk_shape(tokens)
    return {
        "fewer_tokens": (layers, kv, tokens - 4, width),
        "more_tokens": (layers, kv, tokens + 4, width),
        "3d": (kv, tokens, width),  # one layer's chunk, without the layer axis
        "5d": (layers, kv, tokens, 1, width),
        "fewer_layers": (layers - 1, kv, tokens, width),
        "narrower": (layers, kv, tokens, width // 2),
    }


#: Every bad shape through every entry point (one layer of a chunk has no layer axis to lack).
CASES_AND_APIS = [
    (case, api)
    for case in bad_shapes(LAYOUTS["vllm_flash"], 16)
    for api in ("copies", "whole", "layer")
    if (case, api) != ("fewer_layers", "layer")
]


def in_segment(shape: tuple[int, ...], dtype: torch.dtype, fill: Callable[[torch.Tensor], None]) -> tuple:
    """A chunk of ``shape`` between neighbours in one byte segment, as ``(segment, chunk, where)``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize * int(torch.Size(shape).numel())
    segment = torch.empty(NEIGHBOURS + nbytes + NEIGHBOURS, dtype=torch.uint8)
    fill(segment)
    chunk = segment[NEIGHBOURS : NEIGHBOURS + nbytes].view(dtype).view(shape)
    return segment, chunk, slice(NEIGHBOURS, NEIGHBOURS + nbytes)


def random_fill(segment: torch.Tensor) -> None:
    segment.copy_(torch.randint(0, 256, segment.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))


def copy_with(
    connector: TorchConnector, api: str, direction: str, caches: list, slots: torch.Tensor, chunk: torch.Tensor
) -> None:
    """A copy through one of the connector's public entry points; ``layer``: the last layer alone, from or into
    the chunk's last layer (for a 3-D chunk a 2-D tensor, for a 5-D one a 4-D tensor)."""
    if api == "copies":
        ask = connector.gather_copies if direction == "gather" else connector.scatter_copies
        for copy in ask(caches, range(len(caches)), connector.plan_many(slots, [(0, slots.numel())]), [chunk], 2):
            copy()
    elif api == "whole":
        (gather_chunk if direction == "gather" else scatter_chunk)(connector, caches, slots, chunk)
    else:
        copy_layer = connector.gather_layer if direction == "gather" else connector.scatter_layer
        copy_layer(caches[-1], connector.plan(slots), chunk[-1])


def expected_message(layout: KVLayout, api: str, tokens: int, chunk: torch.Tensor) -> str:
    """The error names the shape the plan needs and the one it got."""
    layers, kv, _, width = layout.chunk_shape(tokens)
    if api == "layer":
        return re.escape(f"must be shaped {[kv, tokens, width]}") + ".*" + re.escape(f"got {list(chunk[-1].shape)}")
    return (
        re.escape(f"must be shaped [>= {layers}, {kv}, {tokens}, {width}]")
        + ".*"
        + re.escape(f"got {list(chunk.shape)}")
    )


@pytest.mark.parametrize("case, api", CASES_AND_APIS)
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_a_gather_into_a_chunk_that_does_not_fit_the_plan_writes_nothing(kind: str, case: str, api: str) -> None:
    layout = LAYOUTS[kind]
    slots = slots_for(layout)
    shape = bad_shapes(layout, slots.numel())[case]
    caches = random_caches(layout, NUM_BLOCKS, seed=2)
    segment, chunk, _ = in_segment(shape, layout.dtype, lambda s: s.fill_(UNWRITTEN))
    connector = TorchConnector(EmptyConfig(), layout)

    with pytest.raises(LayoutError, match=expected_message(layout, api, slots.numel(), chunk)):
        copy_with(connector, api, "gather", caches, slots, chunk)
    written = int((segment != UNWRITTEN).sum())
    assert written == 0, f"a refused gather wrote {written} bytes of the segment (the chunk or its neighbours)"


@pytest.mark.parametrize("case, api", CASES_AND_APIS)
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_a_scatter_from_a_chunk_that_does_not_fit_the_plan_writes_nothing(kind: str, case: str, api: str) -> None:
    layout = LAYOUTS[kind]
    slots = slots_for(layout)
    shape = bad_shapes(layout, slots.numel())[case]
    caches = random_caches(layout, NUM_BLOCKS, seed=3)
    before = clone_caches(caches)
    segment, chunk, _ = in_segment(shape, layout.dtype, random_fill)
    kept = segment.clone()
    connector = TorchConnector(EmptyConfig(), layout)

    with pytest.raises(LayoutError, match=expected_message(layout, api, slots.numel(), chunk)):
        copy_with(connector, api, "scatter", caches, slots, chunk)
    assert caches_equal(caches, before), "a refused scatter wrote into the cache (the chunk's neighbours, say)"
    assert torch.equal(segment, kept)


def mixed_caches(layout: KVLayout, odd_dtype: torch.dtype) -> list:
    """Caches of ``layout`` whose last layer holds ``odd_dtype`` (the V tensor only, for a K/V format)."""
    caches = random_caches(layout, NUM_BLOCKS, seed=4)
    last = caches[-1]
    caches[-1] = (last[0], last[1].to(odd_dtype)) if isinstance(last, tuple) else last.to(odd_dtype)
    return caches


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("api", ["copies", "whole", "layer"])
@pytest.mark.parametrize("odd_dtype", [torch.float32, torch.float64, torch.uint8], ids=str)
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_a_layer_of_another_dtype_is_refused_by_name_before_any_copy(
    kind: str, odd_dtype: torch.dtype, api: str, direction: str
) -> None:
    """Layer 0 has the chunk's dtype, the last layer another (its V tensor alone for sglang_mha): nothing is
    copied, not even layer 0; the error names the layer (a call of several layers) and both dtypes."""
    layout = LAYOUTS[kind]
    if odd_dtype == layout.dtype:
        odd_dtype = torch.float64
    slots = slots_for(layout)
    caches = mixed_caches(layout, odd_dtype)
    before = clone_caches(caches)
    fill = (lambda s: s.fill_(UNWRITTEN)) if direction == "gather" else random_fill
    segment, chunk, _ = in_segment(layout.chunk_shape(slots.numel()), layout.dtype, fill)
    kept = segment.clone()
    connector = TorchConnector(EmptyConfig(), layout)
    last = layout.num_layers - 1

    message = f"a chunk of {layout.dtype} cannot be copied to or from a {odd_dtype} KV cache"
    if api != "layer":
        message = f"layer {last}: {message}"
    with pytest.raises(LayoutError, match=re.escape(message)):
        copy_with(connector, api, direction, caches, slots, chunk)
    assert torch.equal(segment, kept), "a refused gather wrote into its chunk or the chunk's neighbours"
    assert caches_equal(caches, before), "a refused scatter wrote into the cache"
