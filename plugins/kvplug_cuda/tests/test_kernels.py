"""The cuda connector's kernels against the torch connector, bit for bit.

Without a GPU the kernels run in Triton's interpreter on CPU tensors; with one, the
same tests run the compiled kernels through pinned staging and the copy stream.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DEVICE,
    DTYPES,
    SGLANG_MHA,
    VLLM_CPU,
    VLLM_FLASH,
    VLLM_MLA,
    caches_same_bits,
    clone,
    make_caches,
    random_bits,
    same_bits,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplug import KVLayout, PagedFormat
from kvplug.errors import LayoutError
from kvplug.testing import gather_chunk, scatter_chunk

KINDS = (VLLM_FLASH, VLLM_MLA, SGLANG_MHA)  # what the kernel addresses; vllm_cpu copies whole blocks only


@st.composite
def cases(draw: st.DrawFn) -> tuple[KVLayout, int, torch.Tensor, int]:
    """A small layout, its block count, a random slot mapping (unique slots, any order) and a seed."""
    kind = draw(st.sampled_from(KINDS))
    dtype = draw(st.sampled_from(DTYPES))
    block_size = 1 if kind is SGLANG_MHA else draw(st.sampled_from([1, 2, 4]))
    heads = 1 if kind.latent else draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([1, 3, 4, 8, 16]))  # odd sizes force narrow words
    layout = KVLayout(
        kind,
        num_layers=draw(st.integers(1, 2)),
        block_size=block_size,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=dtype,
    )
    num_blocks = draw(st.integers(1, 6))
    capacity = num_blocks * block_size
    count = draw(st.integers(1, min(capacity, 10)))
    slots = draw(st.permutations(range(capacity)))[:count]
    return layout, num_blocks, torch.tensor(slots, dtype=torch.long), draw(st.integers(0, 2**31))


def _pair(connectors: dict[str, type], layout: KVLayout):
    return connectors["torch"](connectors["torch"].Config(), layout), connectors["cuda"](
        connectors["cuda"].Config(), layout
    )


def _gather_both(connectors, layout, caches, slots):
    reference, cuda = _pair(connectors, layout)
    expected = torch.empty(layout.chunk_shape(slots.numel()), dtype=layout.dtype)
    gather_chunk(reference, caches, slots.to(DEVICE), expected)
    per_layer = torch.empty_like(expected)
    plan = cuda.plan(slots.to(DEVICE))
    for layer, cache in enumerate(caches):
        cuda.gather_layer(cache, plan, per_layer[layer])
    one_launch = torch.empty_like(expected)
    cuda.gather(caches, slots.to(DEVICE), one_launch)
    cuda.synchronize()
    return expected, per_layer, one_launch


_FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FAST
@given(cases())
def test_gather_is_bit_exact_against_torch(connectors, case) -> None:
    layout, num_blocks, slots, seed = case
    caches = make_caches(layout, num_blocks, torch.Generator().manual_seed(seed))
    expected, per_layer, one_launch = _gather_both(connectors, layout, caches, slots)
    assert same_bits(per_layer, expected)
    assert same_bits(one_launch, expected)


@_FAST
@given(cases())
def test_scatter_is_bit_exact_against_torch(connectors, case) -> None:
    layout, num_blocks, slots, seed = case
    generator = torch.Generator().manual_seed(seed)
    caches = make_caches(layout, num_blocks, generator)
    chunk = random_bits(layout.chunk_shape(slots.numel()), layout.dtype, generator)
    reference, cuda = _pair(connectors, layout)
    expected, per_layer, one_launch = clone(caches), clone(caches), clone(caches)
    scatter_chunk(reference, expected, slots.to(DEVICE), chunk)
    plan = cuda.plan(slots.to(DEVICE))
    for layer, cache in enumerate(per_layer):
        cuda.scatter_layer(cache, plan, chunk[layer])
    cuda.scatter(one_launch, slots.to(DEVICE), chunk)
    cuda.synchronize()
    assert caches_same_bits(per_layer, expected)
    assert caches_same_bits(one_launch, expected)
    assert not caches_same_bits(expected, caches) or slots.numel() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_of_order_blocks_and_a_partial_block(connectors, dtype) -> None:
    layout = KVLayout(VLLM_FLASH, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    caches = make_caches(layout, 8, torch.Generator().manual_seed(1))
    # blocks 5, 2, 7 whole, then 2 tokens of block 0: the usual shape of a prompt's tail
    slots = torch.tensor([20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31, 0, 1])
    expected, per_layer, one_launch = _gather_both(connectors, layout, caches, slots)
    assert same_bits(per_layer, expected) and same_bits(one_launch, expected)
    # and back: the chunk scattered into fresh caches lands where it came from
    _, cuda = _pair(connectors, layout)
    fresh = [torch.zeros_like(c) for c in caches]
    cuda.scatter(fresh, slots.to(DEVICE), expected)
    cuda.synchronize()
    for cache, back in zip(caches, fresh):
        blocks, offsets = slots // 4, slots % 4
        assert same_bits(
            back[:, blocks.to(DEVICE), offsets.to(DEVICE)].cpu(), cache[:, blocks.to(DEVICE), offsets.to(DEVICE)].cpu()
        )


def test_rows_wider_than_one_tile(connectors) -> None:
    """An fp8 latent row of 2049 bytes is copied as 2049 int8 words: three kernel tiles."""
    layout = KVLayout(VLLM_MLA, num_layers=2, block_size=2, num_kv_heads=1, head_dim=2049, dtype=torch.float8_e4m3fn)
    generator = torch.Generator().manual_seed(12)
    caches = make_caches(layout, 3, generator)
    slots = torch.tensor([5, 0, 3])
    expected, per_layer, one_launch = _gather_both(connectors, layout, caches, slots)
    assert same_bits(per_layer, expected) and same_bits(one_launch, expected)
    chunk = random_bits(layout.chunk_shape(3), layout.dtype, generator)
    reference, cuda = _pair(connectors, layout)
    want, got = clone(caches), clone(caches)
    scatter_chunk(reference, want, slots.to(DEVICE), chunk)
    cuda.scatter(got, slots.to(DEVICE), chunk)
    cuda.synchronize()
    assert caches_same_bits(got, want)


def test_strided_heads_of_a_permuted_flash_cache(connectors) -> None:
    """vLLM's HND backends allocate [2, blocks, heads, block_size, dim] and view it as NHD."""
    layout = KVLayout(VLLM_FLASH, num_layers=2, block_size=4, num_kv_heads=3, head_dim=4, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(2)
    caches = [random_bits((2, 5, 3, 4, 4), layout.dtype, generator).to(DEVICE).transpose(2, 3) for _ in range(2)]
    assert not caches[0].is_contiguous()
    slots = torch.tensor([13, 2, 7, 19, 0])
    expected, per_layer, one_launch = _gather_both(connectors, layout, caches, slots)
    assert same_bits(per_layer, expected) and same_bits(one_launch, expected)
    chunk = random_bits(layout.chunk_shape(5), layout.dtype, generator)
    reference, cuda = _pair(connectors, layout)
    want, got = clone(caches), [c.transpose(2, 3).clone().transpose(2, 3) for c in caches]
    scatter_chunk(reference, want, slots.to(DEVICE), chunk)
    cuda.scatter(got, slots.to(DEVICE), chunk)
    cuda.synchronize()
    assert caches_same_bits(got, want)


def test_scatter_takes_a_non_contiguous_chunk_slice(connectors) -> None:
    """The engine scatters ``chunk[layer, :, skip:]`` when a chunk's head is already loaded."""
    layout = KVLayout(SGLANG_MHA, num_layers=1, block_size=1, num_kv_heads=2, head_dim=4, dtype=torch.float16)
    generator = torch.Generator().manual_seed(3)
    caches = make_caches(layout, 16, generator)
    chunk = random_bits(layout.chunk_shape(8), layout.dtype, generator)
    src = chunk[0, :, 3:]
    assert not src.is_contiguous()
    slots = torch.tensor([9, 4, 15, 0, 7])
    reference, cuda = _pair(connectors, layout)
    want, got = clone(caches), clone(caches)
    reference.scatter_layer(want[0], reference.plan(slots.to(DEVICE)), src)
    cuda.scatter_layer(got[0], cuda.plan(slots.to(DEVICE)), src)
    cuda.synchronize()
    assert caches_same_bits(got, want)


def test_slots_outside_the_cache_are_rejected_before_any_copy(connectors) -> None:
    layout = KVLayout(VLLM_MLA, num_layers=1, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16)
    caches = make_caches(layout, 2, torch.Generator().manual_seed(4))
    before = clone(caches)
    _, cuda = _pair(connectors, layout)
    chunk = torch.zeros(layout.chunk_shape(2), dtype=layout.dtype)
    with pytest.raises(LayoutError, match="slot 8 is outside the cache's 8 slots"):
        cuda.scatter(caches, torch.tensor([1, 8], device=DEVICE), chunk)
    with pytest.raises(LayoutError, match="negative slot -1"):
        cuda.plan(torch.tensor([-1, 2], device=DEVICE))
    cuda.synchronize()
    assert caches_same_bits(caches, before)
    assert cuda.stats().pool.in_use_bytes == 0


def test_caches_of_another_dtype_are_rejected(connectors) -> None:
    layout = KVLayout(VLLM_MLA, num_layers=1, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16)
    wrong = KVLayout(VLLM_MLA, num_layers=1, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float16)
    caches = make_caches(wrong, 2, torch.Generator().manual_seed(5))
    _, cuda = _pair(connectors, layout)
    with pytest.raises(LayoutError, match="cache dtype torch.float16 does not match"):
        cuda.gather(caches, torch.tensor([0, 1], device=DEVICE), torch.empty(layout.chunk_shape(2), dtype=layout.dtype))


def test_vllm_cpu_goes_to_the_torch_connector(connectors) -> None:
    """vllm_cpu blocks are packed per CPU ISA: whole-block copies by the reference, bit for bit."""
    layout = KVLayout(VLLM_CPU, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(6)
    caches = [random_bits((5, 2, 4, 16), layout.dtype, generator) for _ in range(2)]
    slots = torch.tensor([12, 13, 14, 15, 4, 5, 6, 7])
    reference, cuda = _pair(connectors, layout)
    expected, got = (torch.empty(layout.chunk_shape(8), dtype=layout.dtype) for _ in range(2))
    gather_chunk(reference, caches, slots, expected)
    cuda.gather(caches, slots, got)
    cuda.synchronize()
    assert same_bits(got, expected)
    assert cuda.stats().fallbacks == 1


#: Formats no engine here declares: the kernel addresses them through kv_views alone
#: (the dim-major one goes to the torch connector: its head rows are not runs).
NEW_FORMATS = (
    PagedFormat("test_head_major", ("block", "head", "kv", "token", "dim")),
    PagedFormat("test_split_blocks", ("block", "token", "head", "dim"), tensors=2),
    PagedFormat("test_token_interleaved", ("slot", "kv", "head", "dim")),
    PagedFormat("test_dim_major", ("dim", "kv", "head", "block", "token")),
)


def _format_caches(layout: KVLayout, num_blocks: int, generator: torch.Generator) -> list:
    shape = layout.cache_shape(num_blocks)
    tensors = layout.format.tensors
    return [
        tuple(random_bits(shape, layout.dtype, generator).to(DEVICE) for _ in range(tensors))
        if tensors > 1
        else random_bits(shape, layout.dtype, generator).to(DEVICE)
        for _ in range(layout.num_layers)
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("fmt", NEW_FORMATS, ids=lambda f: f.name)
def test_a_new_format_is_bit_exact_against_torch(connectors, fmt: PagedFormat, dtype: torch.dtype) -> None:
    layout = KVLayout(fmt, num_layers=2, block_size=4, num_kv_heads=3, head_dim=4, dtype=dtype)
    generator = torch.Generator().manual_seed(7)
    caches = _format_caches(layout, 6, generator)
    slots = torch.tensor([20, 21, 22, 23, 8, 9, 10, 11, 1, 0, 14])  # two whole blocks, then stray tokens
    expected, per_layer, one_launch = _gather_both(connectors, layout, caches, slots)
    assert same_bits(per_layer, expected) and same_bits(one_launch, expected)
    chunk = random_bits(layout.chunk_shape(slots.numel()), layout.dtype, generator)
    reference, cuda = _pair(connectors, layout)
    want, got = clone(caches), clone(caches)
    scatter_chunk(reference, want, slots.to(DEVICE), chunk)
    cuda.scatter(got, slots.to(DEVICE), chunk)
    cuda.synchronize()
    assert caches_same_bits(got, want) and not caches_same_bits(want, caches)
    # head_dim not innermost: head rows are not runs of words, the torch connector copies them
    assert cuda.stats().fallbacks == (0 if fmt.axes[-1] == "dim" else 1)
